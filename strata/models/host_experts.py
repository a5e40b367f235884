"""Routed experts held in host RAM (`--cpu-moe`, `--n-cpu-moe N`): computed on the CPU for steps of few
tokens, streamed to the GPU for prompt chunks of many.

A MoE layer whose routed experts the memory plan leaves in RAM keeps them here, in a format that one
of torch's maintained CPU kernels reads (no hand-written SIMD):

- "float": the model's dtype (fp32 or bf16) through `F.linear` (oneDNN); the only exact format, so a
  float file gives the same experts on the GPU and in RAM;
- "int8": int8 with one scale per output row, through `torch._weight_int8pack_mm` (activations stay
  float);
- "w8a8": the same int8 weights, each token's activations rounded to int8 with a scale of its own
  (as llama.cpp's CPU backend rounds them to Q8 blocks), through `torch._int_mm` (oneDNN's int8 GEMM):
  the default for quantized files where torch has no FBGEMM;
- "fbgemm": the same int8 weights packed for FBGEMM (torch's x86 quantized backend), through its
  dynamic-quantized linear: the rows one expert takes are rounded to uint8 with one scale and zero
  point (a decode step's single token: per token), inside the kernel. Twice oneDNN's rate for a row
  on the hosts measured: quantized files take it by default where there is no C++ compiler;
- "compiled": the same int8 rows as w8a8, activations in fp32; a step runs the layer (every (token,
  expert) pair's gate|up, the activation, down and the weighted sum) as one kernel that torch.compile
  generates (`strata.kernels.host_moe`): a decode step's layer in three quarters of FBGEMM's time on
  the H100's host, so quantized files take it by default where a C++ compiler is found; where the
  kernel cannot be built, w8a8's path;
- "compiled-int4": 4-bit levels in groups of 32 values with an fp32 scale and offset per group, packed
  for the generated loop (`strata.kernels.host_moe.int4_words`), the layer one generated kernel as
  compiled's: three quarters of int8's bytes, rows of a multiple of 128 values;
- "int4": int4 in groups of 32 values with a scale and an offset per group, through
  `torch._weight_int4pack_mm_for_cpu`: half the RAM of int8.

A step's (token, expert) pairs are grouped by expert, so each expert the step chose is read once for
all of its rows (with speculation, one pass over the experts serves every draft token of the step);
the weighted sum over a token's experts is taken in fp32.

For a prompt chunk the same experts are copied to the GPU and computed there by the GPU's kernels
(`ExpertStreamer`): a layer's experts in the GPU's format (`StreamStack`, the file's quantized blocks or
the float stack) wait in pinned host memory, and a side stream copies the next layer's into one of two
GPU buffers while the current layer computes from the other.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F

from strata.kernels.host_moe import (INT4_BLOCK, dequantize_int4_words, int4_words, one_token_moe, one_token_moe_int4,
                                     pairs_moe, pairs_moe_int4)

FORMATS = ("float", "int8", "w8a8", "fbgemm", "compiled", "compiled-int4", "int4", "file")
# No CPU copy: the GPU's format kept for streaming (`StreamStack`) is all RAM holds, and only the GPU
# computes the experts, reading a decode row's chosen ones over PCIe and streaming larger steps.
FILE = "file"
COMPILED = ("compiled", "compiled-int4")  # a step's layer as one generated kernel
INT8_ROWS = ("int8", "w8a8", "compiled")  # formats held as int8 [E, N, K] with a scale per row
# Of those, the ones whose per-expert path rounds each token's activations to int8 (`torch._int_mm`);
# compiled takes it only where its generated kernels cannot be built.
INT8_TOKENS = ("w8a8", "compiled")
INT4_GROUP = 32
# The int4 CPU kernel packs rows in tiles of 16 and groups of INT4_GROUP values: shapes it can take.
INT4_ROW_TILE = 16
_ALIGN = 256  # bytes between the planes carved from one region (any dtype's view stays aligned)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (int8 [..., N, K], fp32 scale [..., N]) with w ≈ q * scale, the scale from
    each row's largest magnitude."""
    w = w.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int32 levels 0..15 [N, K], fp32 scales_and_zeros [K / group, N, 2]) with
    w ≈ (q - 8) * scale + zero per group (the convention of torch's int4 kernels): the group's
    minimum and maximum map to levels 0 and 15."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = (hi - lo).clamp(min=1e-12) / 15.0
    zero = lo + 8.0 * scale
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    scale = scales_and_zeros[..., 0].t().repeat_interleave(group, dim=1)
    zero = scales_and_zeros[..., 1].t().repeat_interleave(group, dim=1)
    return (q.float() - 8.0) * scale + zero


def int8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] -> (int8 [T, K], fp32 scale [T, 1]): each token's row rounded to its own
    scale (w8a8's activations)."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(x / scale).to(torch.int8), scale


def has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _has_vnni() -> bool:
    """Whether the CPU multiplies uint8 by int8 into int32 directly (VNNI, AMX). Without it FBGEMM's
    int16 pair sums can saturate at full-range activations, so they are rounded to 7 bits instead."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(name in flags for name in ("avx512_vnni", "avx_vnni", "amx_int8"))


FBGEMM_REDUCE_RANGE = not _has_vnni()


def format_fits(fmt: str, n: int, k: int) -> bool:
    """Whether a [n, k] weight can be held in `fmt` (int4: rows in tiles of 16, groups of 32; fbgemm:
    where torch has FBGEMM)."""
    if fmt == "int4":
        return n % INT4_ROW_TILE == 0 and k % INT4_GROUP == 0
    if fmt == "compiled-int4":
        return k % INT4_BLOCK == 0
    if fmt == "fbgemm":
        return has_fbgemm()
    return fmt in FORMATS


_PACKERS: list[ThreadPoolExecutor] = []


def _packers() -> ThreadPoolExecutor:
    """Threads that pack weights side by side (one packing runs on one thread, and an 80B-A3B file has
    49k weights to pack), made on first use."""
    if not _PACKERS:
        _PACKERS.append(ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="strata-pack"))
    return _PACKERS[0]


def fbgemm_chains(xs: torch.Tensor, starts: List[int], counts: List[int],
                  gate_up: List[torch.classes.quantized.LinearPackedParamsBase],
                  down: List[torch.classes.quantized.LinearPackedParamsBase], reduce_range: bool) -> torch.Tensor:
    """A step's groups through FBGEMM, group i's expert being `gate_up[i]` and `down[i]`: each group's
    rows of `xs` through its gate|up, one activation over all rows, then each group's rows through its
    down. Run as TorchScript (`fbgemm_chains_scripted`): from Python each call of a custom op costs tens
    of microseconds of argument handling, and a decode step makes two for each expert of each layer in
    RAM."""
    hs: List[torch.Tensor] = []
    for i in range(len(gate_up)):
        hs.append(torch.ops.quantized.linear_dynamic(xs.narrow(0, starts[i], counts[i]), gate_up[i], reduce_range))
    gate, up = torch.cat(hs).chunk(2, dim=-1)
    act = F.silu(gate) * up
    ys: List[torch.Tensor] = []
    row = 0
    for i in range(len(down)):
        ys.append(torch.ops.quantized.linear_dynamic(act.narrow(0, row, counts[i]), down[i], reduce_range))
        row += counts[i]
    return torch.cat(ys)


@functools.cache
def fbgemm_chains_scripted():
    """`fbgemm_chains` compiled by TorchScript once (deprecated in torch, still shipped); where it cannot
    be, the function itself."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.script(fbgemm_chains)
    except Exception:  # noqa: BLE001 - no TorchScript here: the same calls from Python
        return fbgemm_chains


def fbgemm_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_rows`' (q [N, K], scale [N]) on the CPU -> FBGEMM's packed linear weight."""
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; FBGEMM's kernels are not
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def projection_bytes(fmt: str, num_experts: int, n: int, k: int, float_bytes: int = 4) -> int:
    """RAM that E experts' [n, k] projection takes in the CPU format `fmt` (float: `float_bytes` a value)."""
    if fmt == FILE:
        return 0
    if fmt == "float":
        return num_experts * n * k * float_bytes
    if fmt in INT8_ROWS:  # the rows and a fp32 scale each
        return num_experts * (n * k + 4 * n)
    if fmt == "compiled-int4":  # words of 8 levels, a fp32 scale and offset per group of 32
        return num_experts * (n * k // 2 + n * k // INT4_GROUP * 8)
    if fmt == "fbgemm":  # the int8 rows, their scales, zero points and column offsets
        return num_experts * n * (k + 16)
    return num_experts * (n * k // 2 + k // INT4_GROUP * n * 2 * 4)


class HostProjection:
    """E experts' [N, K] projection in one CPU format; `mm(e, x)` is x @ W_eᵀ in fp32."""

    def __init__(self, fmt: str, num_experts: int, n: int, k: int, dtype: torch.dtype = torch.float32):
        if fmt not in FORMATS:
            raise ValueError(f"host expert format must be one of {', '.join(FORMATS)}, not {fmt!r}")
        if not format_fits(fmt, n, k):
            raise ValueError(f"a ({n}, {k}) weight cannot be held as {fmt}")
        self.fmt, self.num_experts, self.n, self.k = fmt, num_experts, n, k
        if fmt == FILE:
            pass
        elif fmt == "float":
            self.w = torch.empty(num_experts, n, k, dtype=dtype)
        elif fmt in INT8_ROWS:
            self.w = torch.empty(num_experts, n, k, dtype=torch.int8)
            self.scale = torch.empty(num_experts, n)
        elif fmt == "compiled-int4":
            self.w = torch.empty(num_experts, n, k // 8, dtype=torch.int32)
            self.scale = torch.empty(num_experts, n, k // 32)
            self.offset = torch.empty(num_experts, n, k // 32)
        else:
            self.packed: list[torch.Tensor | None] = [None] * num_experts
            self.scales_and_zeros: list[torch.Tensor | None] = [None] * num_experts

    def set(self, first: int, w: torch.Tensor) -> None:
        """Experts first.. first + len(w) from float weights w [e, N, K] (on any device: the rounding
        runs there)."""
        last = first + w.shape[0]
        if self.fmt == "float":
            self.w[first:last].copy_(w)
        elif self.fmt in INT8_ROWS:
            q, scale = int8_rows(w)
            self.w[first:last].copy_(q)
            self.scale[first:last].copy_(scale)
        elif self.fmt == "compiled-int4":
            # On the host one expert at a time (the rounding's temporaries stay small); on a GPU the whole
            # chunk at once, whose grid checks wait for the device once a chunk, not once an expert.
            step = 1 if w.device.type == "cpu" else w.shape[0]
            for i in range(0, w.shape[0], step):
                planes = int4_words(w[i : i + step])
                for dst, src in zip((self.w, self.scale, self.offset), planes):
                    dst[first + i : first + i + step].copy_(src)
        elif self.fmt == "fbgemm":
            q, scale = int8_rows(w)
            self.packed[first:last] = _packers().map(fbgemm_pack, q.cpu(), scale.cpu())
        else:
            for i in range(w.shape[0]):
                q, sz = int4_groups(w[i])
                self.packed[first + i] = torch._convert_weight_to_int4pack_for_cpu(q.cpu(), 1)
                self.scales_and_zeros[first + i] = sz.cpu()

    @property
    def nbytes(self) -> int:
        return projection_bytes(self.fmt, self.num_experts, self.n, self.k,
                                self.w.element_size() if self.fmt == "float" else 4)

    def dequantize(self, e: int) -> torch.Tensor:
        """fp32 [N, K]: what `mm` multiplies by (int4: through the kernel, on the identity)."""
        if self.fmt == "float":
            return self.w[e].float()
        if self.fmt in INT8_ROWS:
            return dequantize_int8(self.w[e], self.scale[e])
        if self.fmt == "compiled-int4":
            return dequantize_int4_words(self.w[e], self.scale[e], self.offset[e])
        if self.fmt == "fbgemm":
            return torch.ops.quantized.linear_unpack(self.packed[e])[0].dequantize()
        return self.mm(e, torch.eye(self.k)).t().contiguous()

    def prepare(self, x: torch.Tensor):
        """The rows of every pair of a step, once: w8a8's path rounds them to int8 here."""
        if self.fmt in INT8_TOKENS:
            return int8_tokens(x)
        return x.to(self.w.dtype) if self.fmt == "float" else x.float()

    def _expert_views(self) -> tuple[list, list]:
        """Each expert's weight (w8a8: transposed, as `_int_mm` takes it) and scale as views made once:
        indexing the stacks anew costs more than a decode step's small GEMMs on a fast host."""
        if getattr(self, "_views_of", None) is not self.w:
            w = list(self.w.unbind(0))
            self._views = ([v.t() for v in w] if self.fmt in INT8_TOKENS else w,
                           list(self.scale.unbind(0)) if self.fmt in INT8_ROWS else [])
            self._views_of = self.w
        return self._views

    def mm(self, e: int, x, rows: slice | None = None) -> torch.Tensor:
        """x (or `prepare(x)`) [T, K], rows of it -> fp32 [T, N] through expert e's weight."""
        if self.fmt == "compiled-int4":  # only where the generated kernels cannot be built: slow, exact
            x = x if rows is None else x[rows]
            return F.linear(x.float(), self.dequantize(e))
        if self.fmt == "int4":
            x = x if rows is None else x[rows]
            return torch._weight_int4pack_mm_for_cpu(x.float(), self.packed[e], INT4_GROUP, self.scales_and_zeros[e])
        if self.fmt == "fbgemm":
            x = x if rows is None else x[rows]
            return torch.ops.quantized.linear_dynamic(x.float(), self.packed[e], FBGEMM_REDUCE_RANGE)
        w, scale = self._expert_views()
        if self.fmt in INT8_TOKENS:
            q, s = x if isinstance(x, tuple) else int8_tokens(x)
            if rows is not None:
                q, s = q[rows], s[rows]
            return torch._int_mm(q, w[e]).float().mul_(s * scale[e])
        if rows is not None:
            x = x[rows]
        if self.fmt == "float":
            return F.linear(x.to(self.w.dtype), w[e]).float()
        return torch._weight_int8pack_mm(x.float(), w[e], scale[e])


@dataclass
class StreamStack:
    """One layer's experts in the GPU's format, in one region of pinned host memory: "quant" (the
    file's blocks as `moe_q.QExpertStack` planes, gate|up then down) or "float" (w13 [E, 2I, H] and
    w2 [E, H, I] in the model's dtype). `views(region)` carves the same layout from any region."""

    kind: str
    layout: tuple  # (plane name, dtype, shape, byte offset) for each plane
    meta: tuple  # quant: (type13, type2, E, n13, k13, n2, k2); float: ()
    region: torch.Tensor  # uint8, pinned when CUDA is there

    @property
    def nbytes(self) -> int:
        return self.region.numel()

    @classmethod
    def build(cls, kind: str, planes: dict[str, torch.Tensor], meta: tuple) -> "StreamStack":
        layout, offset = [], 0
        for name, p in planes.items():
            layout.append((name, p.dtype, tuple(p.shape), offset))
            offset += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        region = torch.empty(offset, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        stack = cls(kind, tuple(layout), meta, region)
        for name, view in stack.views(region).items():
            view.copy_(planes[name])
        return stack

    @classmethod
    def of_float(cls, w13: torch.Tensor, w2: torch.Tensor) -> "StreamStack":
        return cls.build("float", {"w13": w13, "w2": w2}, ())

    @classmethod
    def of_quant(cls, w13, w2) -> "StreamStack":
        """From two `QExpertStack`s on the CPU."""
        planes = {f"13.{n}": p for n, p in w13.planes.items()} | {f"2.{n}": p for n, p in w2.planes.items()}
        return cls.build("quant", planes, (w13.ggml_type, w2.ggml_type, w13.num_experts, w13.n, w13.k, w2.n, w2.k))

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, dtype, shape, offset in self.layout:
            size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            out[name] = region[offset : offset + size].view(dtype).view(shape)
        return out

    def stacks(self, region: torch.Tensor) -> tuple:
        """The layer's (w13, w2) over `region`: tensors ("float") or `QExpertStack`s ("quant")."""
        v = self.views(region)
        if self.kind == "float":
            return v["w13"], v["w2"]
        from strata.kernels.quant.moe_q import QExpertStack

        t13, t2, e, n13, k13, n2, k2 = self.meta
        p13 = {n[3:]: p for n, p in v.items() if n.startswith("13.")}
        p2 = {n[2:]: p for n, p in v.items() if n.startswith("2.")}
        return QExpertStack(t13, e, n13, k13, p13), QExpertStack(t2, e, n2, k2, p2)


class HostExperts:
    """One MoE layer's routed experts in host RAM: gate|up [E, 2I, H] and down [E, H, I] in a CPU format,
    and, where a GPU will stream them, the same experts in its format (`stream`)."""

    def __init__(self, fmt: str, num_experts: int, inter: int, hidden: int, dtype: torch.dtype = torch.float32):
        self.fmt = fmt
        self.gate_up = HostProjection(fmt, num_experts, 2 * inter, hidden, dtype)
        self.down = HostProjection(fmt, num_experts, hidden, inter, dtype)
        self.stream: StreamStack | None = None
        self.scripted = True  # fbgemm: the step's calls from TorchScript (False: from Python, as a benchmark compares)
        # What `forward` has done: seconds on the CPU, expert weight bytes read (`strata bench offload`).
        self.seconds = 0.0
        self.bytes_read = 0

    @property
    def num_experts(self) -> int:
        return self.gate_up.num_experts

    @property
    def on_cpu(self) -> bool:
        """Whether the CPU can compute these experts (every format but `FILE`)."""
        return self.fmt != FILE

    @property
    def nbytes(self) -> int:
        """RAM held: the CPU format and the GPU's (one region when the CPU reads the streamed stack)."""
        if self.stream is None:
            return self.gate_up.nbytes + self.down.nbytes
        shared = self.fmt == "float" and self.gate_up.w.data_ptr() == self.stream.region.data_ptr()
        return self.stream.nbytes + (0 if shared else self.gate_up.nbytes + self.down.nbytes)

    def set(self, first: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Experts first.. from float stacks w13 [e, 2I, H] (gate rows, then up rows) and w2 [e, H, I]."""
        self.gate_up.set(first, w13)
        self.down.set(first, w2)

    @classmethod
    def from_stacks(cls, w13: torch.Tensor, w2: torch.Tensor, fmt: str = "float") -> "HostExperts":
        e, two_i, h = w13.shape
        out = cls(fmt, e, two_i // 2, h, w13.dtype if fmt == "float" else torch.float32)
        out.set(0, w13, w2)
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], ids [T, k], weights [T, k] on the CPU -> fp32 [T, H] (into `out` if given):
        sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
        t0 = time.perf_counter()
        out = self._forward(x, ids, weights, out)
        self.seconds += time.perf_counter() - t0
        return out

    def _forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None
                 ) -> torch.Tensor:
        """`forward`, untimed."""
        if not self.on_cpu:
            raise RuntimeError("these routed experts are kept in RAM in the GPU's format only (host_experts file): "
                               "the CPU cannot compute them")
        t, k = ids.shape
        flat = ids.reshape(-1)
        if self.fmt in COMPILED and (y := self._compiled(x, flat, weights, out)) is not None:
            return y
        if t == 1:  # one token: its k experts, no sort
            groups = [(e, slice(j, j + 1)) for j, e in enumerate(flat.tolist())]
            xs = self.gate_up.prepare(x)
            rows_of = [slice(0, 1)] * k
            weight_of = weights.reshape(-1, 1).float()
        else:
            order = torch.argsort(flat, stable=True)
            experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
            token_of = order // k
            groups, start = [], 0
            for e, c in zip(experts.tolist(), counts.tolist()):
                groups.append((e, slice(start, start + c)))
                start += c
            xs = self.gate_up.prepare(x.index_select(0, token_of))
            rows_of = [s for _, s in groups]
            weight_of = weights.reshape(-1).float()[order, None]
        self.bytes_read += len(groups) * (self.gate_up.nbytes + self.down.nbytes) // self.num_experts
        if self.fmt == "fbgemm" and self.scripted:
            chains = fbgemm_chains_scripted()
            y = chains(xs, [r.start for r in rows_of], [r.stop - r.start for r in rows_of],
                       [self.gate_up.packed[e] for e, _ in groups], [self.down.packed[e] for e, _ in groups],
                       FBGEMM_REDUCE_RANGE) * weight_of
        else:
            h = torch.cat([self.gate_up.mm(e, xs, r) for (e, _), r in zip(groups, rows_of)])
            gate, up = h.chunk(2, dim=-1)
            act = self.down.prepare(F.silu(gate) * up)
            y = torch.cat([self.down.mm(e, act, s) for e, s in groups]) * weight_of
        if out is None:
            out = torch.empty(t, y.shape[1], dtype=torch.float32)
        if t == 1:
            return torch.sum(y, dim=0, keepdim=True, out=out)
        out.zero_()
        return out.index_add_(0, token_of, y)

    def _compiled(self, x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None
                  ) -> torch.Tensor | None:
        """The compiled format's step: one generated kernel for the layer (`strata.kernels.host_moe`), or
        None where it cannot be built here."""
        t, k = x.shape[0], flat.shape[0] // x.shape[0]
        g, d = self.gate_up, self.down
        int4 = self.fmt == "compiled-int4"
        if int4:
            planes = tuple(t.view(-1, t.shape[-1]) for p in (g, d) for t in (p.w, p.scale, p.offset))
        else:
            planes = (g.w.view(-1, g.k), g.scale.view(-1), d.w.view(-1, d.k), d.scale.view(-1))
        if t == 1:
            if (kernel := (one_token_moe_int4 if int4 else one_token_moe)()) is None:
                return None
            y = kernel(x.float(), flat, weights.reshape(-1).float(), *planes)
            self.bytes_read += k * (g.nbytes + d.nbytes) // self.num_experts
            return y if out is None else out.copy_(y)
        order = torch.argsort(flat, stable=True)  # pairs of one expert side by side: its rows stay in cache
        token_of = order // k
        y = (pairs_moe_int4 if int4 else pairs_moe)(x.float().index_select(0, token_of), flat[order],
                                                    weights.reshape(-1).float()[order], *planes)
        if y is None:
            return None
        self.bytes_read += len(flat.unique()) * (g.nbytes + d.nbytes) // self.num_experts
        if out is None:
            out = torch.empty(t, y.shape[1], dtype=torch.float32)
        return out.zero_().index_add_(0, token_of, y)


NEVER = 1 << 30  # a step size no step reaches: the CPU computes every step


def host_step_seconds(host: HostExperts, tokens: int, k: int, dtype: torch.dtype = torch.float32, repeats: int = 2,
                      seed: int = 0) -> float:
    """The CPU time of one step of `tokens` rows through `host`, each row routed to `k` distinct experts
    drawn uniformly, anew for each of `repeats` (best of them: a repeat of the same experts would find
    them in the CPU's caches, as a decode's next token mostly does not); the counters `seconds` and
    `bytes_read` are left as they were."""
    g = torch.Generator().manual_seed(seed)
    hidden = host.gate_up.k
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    seconds, read = host.seconds, host.bytes_read
    best = float("inf")
    for _ in range(repeats):
        ids = torch.rand(tokens, host.num_experts, generator=g).argsort(dim=1)[:, :k].contiguous()
        t0 = time.perf_counter()
        host._forward(x, ids, w, None)
        best = min(best, time.perf_counter() - t0)
    host.seconds, host.bytes_read = seconds, read
    return best


def stream_crossover(cpu_seconds: dict[int, float], copy_seconds: float) -> int:
    """The fewest tokens at which copying a layer's experts to the GPU (`copy_seconds`) costs less than
    computing a step's chosen experts on the CPU (`cpu_seconds[T]`, measured at two or more step sizes T):
    the first measured T past the copy, else T extrapolated along the last two sizes (once a step touches
    every expert it grows by its rows' arithmetic alone), else NEVER when the CPU time does not grow."""
    sizes = sorted(cpu_seconds)
    for t in sizes:
        if cpu_seconds[t] >= copy_seconds:
            return t
    (t1, c1), (t2, c2) = ((t, cpu_seconds[t]) for t in sizes[-2:])
    slope = (c2 - c1) / (t2 - t1)
    return t2 + math.ceil((copy_seconds - c2) / slope) if slope > 0 else NEVER


class HostStaging:
    """Pinned buffers a CUDA step's host-expert layers pass their rows through (reserved once, per
    stream, so the read stage's thread and the decode thread never share one): the rows, ids and
    routing weights down, the experts' sum back up into a device buffer."""

    def __init__(self, tokens: int, hidden: int, k: int, dtype: torch.dtype, device: torch.device):
        self.x = torch.empty(tokens, hidden, dtype=dtype, pin_memory=True)
        self.ids = torch.empty(tokens, k, dtype=torch.int64, pin_memory=True)
        self.w = torch.empty(tokens, k, dtype=torch.float32, pin_memory=True)
        self.out = torch.empty(tokens, hidden, dtype=torch.float32, pin_memory=True)
        self.out_cast = torch.empty(tokens, hidden, dtype=dtype, pin_memory=True)
        self.dev = torch.empty(tokens, hidden, dtype=dtype, device=device)
        self.event = torch.cuda.Event()

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    def down(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, mark: bool = True) -> tuple[torch.Tensor, ...]:
        """The rows' copies down (ids and weights [T, j], j up to the k reserved: contiguous on the host),
        and (`mark`) `event` recorded after them; not under a graph capture, whose host parts wait for
        the whole piece instead."""
        t, j = ids.shape
        idh, wh = self.ids.view(-1)[: t * j].view(t, j), self.w.view(-1)[: t * j].view(t, j)
        self.x[:t].copy_(x, non_blocking=True)
        idh.copy_(ids, non_blocking=True)
        wh.copy_(w, non_blocking=True)
        if mark:
            self.event.record()
        return self.x[:t], idh, wh

    def up(self, y: torch.Tensor) -> torch.Tensor:
        """y: a view of `out`: cast on the host, one copy up (read before the stream's next `down`)."""
        t = y.shape[0]
        self.out_cast[:t].copy_(y)
        return self.dev[:t].copy_(self.out_cast[:t], non_blocking=True)


class HostStagingPool:
    """One `HostStaging` for each CUDA stream that runs host-expert layers, made at its first step."""

    def __init__(self, tokens: int, hidden: int, k: int, dtype: torch.dtype, device: torch.device):
        self.tokens, self.shape = tokens, (tokens, hidden, k, dtype, device)
        self.by_stream: dict[int, HostStaging] = {}

    def get(self) -> HostStaging:
        key = torch.cuda.current_stream().cuda_stream
        staging = self.by_stream.get(key)
        if staging is None:
            staging = self.by_stream[key] = HostStaging(*self.shape)
        return staging

    def reserve(self, streams) -> None:
        """Staging for each of `streams` now, at start-up, rather than at its first step."""
        for s in streams:
            with torch.cuda.stream(s):
                self.get()


class ExpertStreamer:
    """Copies the host-expert layers' `StreamStack`s to the GPU in layer order, two buffers deep: while a
    layer computes from one buffer, a side stream fills the other with the next layer's experts. A
    lock makes one thread's layer (acquire .. release) whole when two threads stream."""

    def __init__(self, layers: list, device: torch.device):
        self.order = {id(m): i for i, m in enumerate(layers)}
        self.layers = layers
        size = max(m.host.stream.nbytes for m in layers)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        self.holds: list[int | None] = [None, None]  # which layer each buffer holds (or is filling)
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.free = [torch.cuda.Event(), torch.cuda.Event()]
        self.stream = torch.cuda.Stream(device)
        self.lock = threading.Lock()
        self.bytes_copied = 0
        # Whether float stacks go through torch._grouped_mm on this device (else a loop): `probe_float`.
        self.float_grouped = False

    def probe_float(self, works) -> None:
        """`works(w13, w2)` (moe.grouped_mm_works) on the first layer's streamed stacks, when float."""
        if self.layers[0].host.stream.kind == "float":
            self._fill(0, 0)
            torch.cuda.current_stream().wait_event(self.ready[0])
            self.float_grouped = works(*self.layers[0].host.stream.stacks(self.buffers[0]))
            self.free[0].record()
            self.bytes_copied = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def copy_seconds(self, repeats: int = 2) -> float:
        """One copy of the largest layer's experts into a buffer, timed on the side stream (best of
        `repeats`)."""
        i = max(range(len(self.layers)), key=lambda j: self.layers[j].host.stream.nbytes)
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(self.buffers[0].device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            self._fill(i, 0)
            end.record(self.stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        self.bytes_copied = 0
        return best

    def _fill(self, i: int, slot: int) -> None:
        stack = self.layers[i].host.stream
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.free[slot])
            self.buffers[slot][: stack.nbytes].copy_(stack.region, non_blocking=True)
            self.ready[slot].record(self.stream)
        self.holds[slot] = i
        self.bytes_copied += stack.nbytes

    def acquire(self, moe) -> tuple[int, tuple]:
        """moe's experts on the GPU: (slot, its stacks). The current stream waits for their copy, and the
        next layer's starts on the side stream. Hold `lock` until `release`."""
        i = self.order[id(moe)]
        slot = self.holds.index(i) if i in self.holds else None
        if slot is None:
            slot = i % 2
            self._fill(i, slot)
        torch.cuda.current_stream().wait_event(self.ready[slot])
        n = len(self.layers)
        if n > 2 and self.holds[1 - slot] != (i + 1) % n:
            self._fill((i + 1) % n, 1 - slot)
        return slot, self.layers[i].host.stream.stacks(self.buffers[slot])

    def release(self, slot: int) -> None:
        self.free[slot].record()
