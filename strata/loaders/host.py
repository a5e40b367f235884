"""Routed experts placed in host RAM at load (`--cpu-moe`, `--n-cpu-moe N`, the memory plan): the CPU format
each layer's experts take (`host_format`), the layers marked before the read (`place_host_experts`), each
layer's `HostExperts` made as its experts arrive (`HostLayers`), and experts loaded on the GPU moved to RAM
afterwards (`move_experts_to_ram`), when the plan is made again from what the load measured."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Collection

import torch
from torch import nn

from strata.loaders.base import Checkpoint, LoadError
from strata.models.host_experts import FILE
from strata.models.transformer import CausalLM

log = logging.getLogger("strata")


# GGUF types whose groups of 32 are 16 evenly spaced levels of their own: compiled-int4 holds them exactly.
INT4_EXACT = frozenset({"IQ3_S", "Q4_K", "Q4_0"})


def host_format(stored_types: str | Collection[str | None] | None, shapes: Collection[tuple[int, int]],
                int8_fits: bool = True) -> str:
    """The CPU format of routed experts stored as `stored_types` (a layer's safetensors dtypes or GGUF type
    names): float for float weights (exact). Quantized files where torch.compile finds a C++ compiler take
    the generated kernels (`strata.kernels.host_moe`): compiled-int4 (4-bit groups of 32 with an fp32
    scale and offset, 6 bits a weight) where every expert tensor's type is one of `INT4_EXACT`, whose
    weights it keeps exactly, in 70% of int8's bytes (0.61 ms against 0.70 for an 80B-A3B layer's step
    on the H200 host, bench/results/host_int4_compiled_cuda.txt); else int8 rows, compiled (0.36 ms,
    87 GB/s, on the H100 host against FBGEMM's 0.49, bench/results/host_expert_layers_cuda.txt), unless
    host RAM cannot hold an int8 copy (`int8_fits`): then compiled-int4 all the same. Without a compiler:
    fbgemm, else w8a8 (oneDNN's int8 GEMM), or int4 (torch's kernel) where RAM needs 4 bits; the 4-bit
    formats only where every weight's shape takes them."""
    from strata.kernels.host_moe import has_cpp_compiler
    from strata.models.host_experts import format_fits, has_fbgemm

    types = {stored_types} if stored_types is None or isinstance(stored_types, str) else set(stored_types)
    if not types or any(t is None or t.upper() in ("F32", "F16", "BF16", "F64") for t in types):
        return "float"
    compiler = has_cpp_compiler()
    if compiler and all(t.upper() in INT4_EXACT for t in types) and all(format_fits("compiled-int4", *s) for s in shapes):
        return "compiled-int4"
    if not int8_fits:
        for fmt in (("compiled-int4", "int4") if compiler else ("int4",)):
            if all(format_fits(fmt, *s) for s in shapes):
                return fmt
    return "compiled" if compiler else "fbgemm" if has_fbgemm() else "w8a8"


def host_memory_available() -> int | None:
    """Bytes the kernel says new allocations can take without swapping (MemAvailable), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


FOUR_BITS = "4 bits"  # `ram_format`: no room for an int8 copy (no format of that name)


def ram_format(ckpt: Checkpoint, layers: Collection[int], fmt: str, gpu: bool, quiet: bool = False) -> str | None:
    """What host RAM leaves of `fmt` for the routed experts of MoE layers `layers`: under "auto", None when
    it holds an int8 copy beside the file's blocks kept for streaming (each layer's `host_format` then
    decides), else `FOUR_BITS` (`host_format` with no room for int8), or on CUDA (`gpu`) `file`
    where it cannot hold a 4-bit one (6 bits a weight with its scales and offsets) either; any other
    `fmt` as given. One answer for the load (`place_host_experts`) and the memory plan."""
    if fmt != "auto":
        return fmt
    if not layers:
        return None
    prefixes = tuple(f"model.layers.{i}.mlp.experts." for i in layers)
    mine = [n for n in ckpt.names if n.startswith(prefixes)]
    weights, blocks = (sum(f(n) for n in mine) for f in (lambda n: math.prod(ckpt.shapes.get(n, ())),
                                                         lambda n: ckpt.nbytes.get(n, 0)))
    available = host_memory_available()
    if available is None or weights + blocks <= 0.9 * available:
        return None
    if gpu and weights * 3 // 4 + blocks > 0.9 * available:
        if not quiet:
            log.info("routed experts in RAM as the file's blocks only, read by the GPU (host_experts file): a 4-bit "
                     "CPU copy beside them (%.1f GiB) is more than the %.1f GiB of host memory available",
                     (weights * 3 // 4 + blocks) / 2**30, available / 2**30)
        return FILE
    if not quiet:
        log.info("routed experts in RAM in 4 bits: an int8 copy (%.1f GiB with the streaming copy) is more than "
                 "the %.1f GiB of host memory available", (weights + blocks) / 2**30, available / 2**30)
    return FOUR_BITS


def layer_format(ram: str | None, stored: set | None, inter: int, hidden: int) -> str:
    """A layer's CPU format from `ram_format`'s answer and the layer's stored expert types."""
    if ram is None or ram == FOUR_BITS:
        return host_format(stored, [(2 * inter, hidden), (hidden, inter)], int8_fits=ram is None)
    return ram


def place_host_experts(model: CausalLM, ckpt: Checkpoint, layers: Collection[int], fmt: str,
                       gpu: bool = False) -> set[str]:
    """Marks the MoE layers among `layers` to keep their routed experts in RAM (`MoE.host_format`, as
    `ram_format` and `layer_format` decide); returns those experts' tensor names, which `HostLayers`
    gathers as they are read. `gpu`: a CUDA load."""
    from strata.models.moe import MoE

    names: set[str] = set()
    ram = ram_format(ckpt, layers, fmt, gpu)
    for i in sorted(set(layers)):
        if i >= model.num_layers:
            raise LoadError(ckpt.path, f"no layer {i} to place experts of (the model has {model.num_layers})")
        moe = next((m for m in model.model.layers[i].modules() if isinstance(m, MoE)), None)
        if moe is None:
            continue  # a dense layer of a MoE model: nothing to place
        prefix = next(n for n, m in model.named_modules() if m is moe) + ".experts."
        mine = {n for n in ckpt.names if n.startswith(prefix)}
        inter, hidden = moe.experts[0].gate_proj.weight.shape
        moe.host_format = layer_format(ram, {ckpt.types.get(n) for n in mine} if mine else None, inter, hidden)
        names |= mine
    return names


class HostLayers:
    """The routed experts of the layers placed in RAM, gathered as they are read; a layer's
    `HostExperts` is made as soon as its last expert arrives, so at most one layer is held in float.
    On CUDA each layer is also kept in the GPU's format for the streamer (the file's blocks where the GPU
    has kernels for them, else the float stack in the model's dtype), and quantized blocks are converted
    to the CPU format on the GPU, a few experts at a time (on the host, an 80B-A3B IQ3_S file's
    conversion takes minutes)."""

    _NAME = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

    def __init__(self, model: CausalLM, ckpt: Checkpoint, names: set[str], dtype: torch.dtype, device: torch.device):
        from strata.models.moe import MoE

        self.stream = device.type == "cuda"
        self.work = device if self.stream else torch.device("cpu")
        self.ckpt, self.dtype, self.names = ckpt, dtype, names
        self.pending: dict[int, dict] = {}
        self.built, self.seconds = 0, 0.0
        self.moe_of: dict[str, MoE] = {}
        for name, m in model.named_modules():
            if isinstance(m, MoE) and m.host_format is not None:
                self.moe_of[name + ".experts."] = m

    def add(self, name: str) -> None:
        prefix = name[: name.index(".experts.") + len(".experts.")]
        moe = self.moe_of[prefix]
        e, proj = self._NAME.search(name).groups()
        raw = self.ckpt.raw(name) if self.ckpt.raw is not None else None
        value = raw if raw is not None else self.ckpt.get(name)
        got = self.pending.setdefault(id(moe), {})
        got[(int(e), proj)] = value
        if len(got) == 3 * moe.num_experts:
            del self.pending[id(moe)]
            t0 = time.perf_counter()
            self._build(moe, got)
            self.built, self.seconds = self.built + 1, self.seconds + time.perf_counter() - t0

    def _build(self, moe, got: dict) -> None:
        from strata.kernels.quant.moe_q import QExpertStack

        n = moe.num_experts
        trios = [(got[(e, "gate")], got[(e, "up")], got[(e, "down")]) for e in range(n)]
        raws = all(isinstance(v, tuple) for t in trios for v in t)
        types13 = {v[0] for t in trios for v in t[:2]} if raws else set()
        types2 = {t[2][0] for t in trios} if raws else set()
        if raws and len(types13) == 1 and len(types2) == 1:
            w13 = QExpertStack.from_raw(types13.pop(), torch.stack([torch.cat([g[1], u[1]]) for g, u, _ in trios]))
            w2 = QExpertStack.from_raw(types2.pop(), torch.stack([d[1] for _, _, d in trios]))
        else:
            floats = [[self._float(v) for v in t] for t in trios]
            w13 = torch.stack([torch.cat([g, u]) for g, u, _ in floats])
            w2 = torch.stack([d for _, _, d in floats])
            del floats
        del trios, got
        moe.host = host_experts_of(moe.host_format, w13, w2, self.dtype, self.work, self.stream)
        _empty_experts(moe, self.dtype)

    def _float(self, v) -> torch.Tensor:
        if not isinstance(v, tuple):
            return v.float()
        from strata.kernels.quant import format_module

        mod = format_module(v[0])
        return mod.dequantize(mod.repack(v[1]), v[1].shape[0], v[1].shape[1] // mod.BLOCK_BYTES * mod.BLOCK_VALUES)

    def check_done(self) -> None:
        if self.pending:
            raise LoadError(self.ckpt.path, f"{len(self.pending)} MoE layers placed in RAM lack some of their experts")
        log.info("routed experts of %d MoE layers made ready for RAM in %.1f s (converted on the %s)", self.built,
                 self.seconds, "GPU" if self.stream else "CPU")


CHUNK = 8  # experts converted at once: ~0.4 GiB of fp32 temporaries at 80B-A3B's expert shape


def host_experts_of(fmt: str, w13, w2, dtype: torch.dtype, work: torch.device, stream: bool):
    """One MoE layer's routed experts as `HostExperts` in the CPU format `fmt`, from (w13, w2): the file's
    blocks as `QExpertStack`s, or float stacks [E, 2I, H] and [E, H, I], on any device. Quantized blocks
    are converted on `work` a few experts at a time; `stream`: also kept in the GPU's format (the blocks,
    else the float stack in `dtype`), pinned, for the streamer."""
    from strata.models.host_experts import HostExperts, StreamStack

    quant = not isinstance(w13, torch.Tensor)
    n, rows, hidden = (w13.num_experts, w13.n, w13.k) if quant else tuple(w13.shape)
    float_dtype = dtype if fmt == "float" else torch.float32
    host = HostExperts(fmt, n, rows // 2, hidden, float_dtype)
    if fmt == FILE:
        if not stream:
            raise ValueError("host_experts file keeps the experts for the GPU alone: it needs CUDA")
        host.stream = StreamStack.of_quant(w13, w2) if quant else StreamStack.of_float(w13.to(dtype), w2.to(dtype))
        return host
    if quant:
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            host.set(a, torch.stack([w13.dequantize_expert(e, work) for e in range(a, b)]),
                     torch.stack([w2.dequantize_expert(e, work) for e in range(a, b)]))
        if stream:
            host.stream = StreamStack.of_quant(w13, w2)
        return host
    w13, w2 = w13.to("cpu", float_dtype), w2.to("cpu", float_dtype)
    if stream:
        host.stream = StreamStack.of_float(w13.to(dtype), w2.to(dtype))
        if fmt == "float" and float_dtype == dtype:
            # The CPU computes from the pinned stack itself: one copy in RAM, not two.
            host.gate_up.w, host.down.w = host.stream.stacks(host.stream.region)
    if host.stream is None or host.gate_up.w.data_ptr() != host.stream.region.data_ptr():
        host.set(0, w13, w2)
    return host


def _empty_experts(moe, dtype: torch.dtype) -> None:
    """The experts' own parameters emptied once `moe.host` holds them."""
    for m in moe.experts:
        for lin in (m.gate_proj, m.up_proj, m.down_proj):
            lin.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def move_experts_to_ram(model: CausalLM, ckpt: Checkpoint, layers: Collection[int], fmt: str,
                        dtype: torch.dtype) -> None:
    """MoE layers `layers`, loaded with their routed experts on the GPU, keep them in host RAM instead, in
    the format a load would have placed them in (`fmt`, "auto": `host_format`): a memory plan made again
    after the load held more than the plan estimated (`strata.memory_plan.beyond_estimate`)."""
    from strata.models.moe import MoE

    place_host_experts(model, ckpt, layers, fmt, gpu=True)
    for i in sorted(set(layers)):
        layer = model.model.layers[i]
        moe = next((m for m in layer.modules() if isinstance(m, MoE)), None)
        if moe is None or moe.host is not None:
            continue
        if moe.quant is not None:
            w13, w2 = moe.quant
        elif moe.w13 is not None and moe.w13_ext is None and moe.fp8 is None:
            w13, w2 = moe.w13, moe.w2
        else:
            raise LoadError(ckpt.path, f"layer {i}'s routed experts cannot move to RAM after the load")
        device = w13.device
        moe.host = host_experts_of(moe.host_format, w13, w2, dtype, device, device.type == "cuda")
        moe.quant = moe.qdecode = None
        moe.w13 = moe.w2 = None
        del w13, w2
        _empty_experts(moe, dtype)
        moe.pack_experts()  # the host path: routing workspaces, `path`
        if getattr(layer, "cpu_plan", None) is not None:
            layer.plan_cpu(None)  # a CPU plan made with the experts in place covers the layer no more
