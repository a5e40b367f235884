"""Matrix × vector for decode-sized batches: out [M, N] = x [M, K] @ weight [N, K]ᵀ (+ bias), M ≤ 16.

Semantics (`gemv_ref`): F.linear in fp32, rounded once to x's dtype. With act="silu_mul", x is
[M, 2K], gate in its first K columns and up in the last K, and the product uses `F.silu(gate) * up`
with torch's roundings (silu in fp32 rounded to the dtype, then the product rounded to the dtype),
so the SwiGLU kernel before a down projection disappears.

Kernel. At M ≤ 16 the weights are the whole cost: each program owns BLOCK_N output columns for all
rows and streams its [BLOCK_N, BLOCK_K] weight tiles through the software pipeline (num_stages
copies in flight), multiplying them on the tensor cores with the transposed x tile padded to
BLOCK_M = 16 rows (weights as the MMA's M side, "swap AB": with BLOCK_N ≥ 64 and 4 warps Hopper
gets wgmma, which reads each shared tile once per warp group). With split-K, program (tile, s)
covers the s-th of SPLIT_K equal ranges of K blocks, writes its fp32 partial to a workspace and
bumps the tile's counter; the program that arrives last sums the partials in split order 0, 1, ...
(whichever program that is), adds the bias, writes the output and resets the counter to zero, so
no second launch is needed and a workspace is reusable on the same stream.

Determinism and batch invariance: the configuration (tile sizes, split count) is a function of
(N, K) and the device alone (`strata.kernels.device`: the split follows its SM count, the stages its
shared memory), BLOCK_M is 16 for every M and M is a runtime argument that Triton does not
specialise on, so every M ≤ 16 runs the same binary; tensor-core rows are independent and the K
order (blocks in order inside a split, splits summed in index order) is fixed, so a row's result is
bit-identical whether it is computed alone or among 15 others, and from run to run.

CUDA graphs: the grid comes from shapes only and nothing is read back to the host; under capture
the allocations (out when none is passed, a zeroed workspace when none is passed) come from the
graph pool. A workspace must not be shared by launches that may run concurrently (two streams).
Batch invariance covers M ≤ 16, the kernel's range; `gemv` hands larger M to cuBLAS.

Scaled 8-bit weights (`scale=`, the W8 constexpr; the decode path of `strata.kernels.quant.fp8`):
weight is e4m3 [N, K] with one fp32 scale per output column; out = (x @ weightᵀ) · scale with the
products exact (every e4m3 value is a bf16 and an fp16) and summed in fp32, the scale applied once
to the sum by the program that writes the column (after the split-K reduce), one rounding. Tiles are
read as int32 words of four values and turned into x's dtype in registers by integer bit moves and
one packed multiply per two values (`_e4m3_quads`): the hardware conversion costs three quarter-rate
instructions per two bf16 values, which in SASS made the kernel issue-bound below the HBM rate.
The even and odd K positions of a tile go through two dots (`_w8_dot`), which keeps each converted
pair where the MMA wants it. Compiled for sm_90 (Triton 3.6) at the 8B shapes: 3.2-3.6 instructions
per weight value in the loop, 1.7-1.9 of them integer, no spills. With W8 off the 16-bit kernel's
SASS is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from strata.kernels import device as devices
from strata.kernels import use_pdl, use_triton
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.splitk import split_k_numel, split_k_parts, split_k_reduce, split_k_views
from strata.kernels.triton_import import jit, libdevice, tl

if tl is not None:
    constexpr = tl.constexpr
else:  # CPU-only installs: the kernels are never launched

    def constexpr(value):
        return value


BLOCK_M = 16  # rows of the MMA: M is padded to it, whatever M is, so every M runs one binary
MAX_ROWS = BLOCK_M
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns (weight rows) per program, a power of two >= 16
    block_k: int  # K per pipeline stage, a power of two dividing K
    split_k: int = 1  # programs per column tile, each over an equal share of the K blocks
    num_warps: int = 4
    num_stages: int = 4

    def programs(self, n: int) -> int:
        return _cdiv(n, self.block_n) * self.split_k

    def stage_bytes(self, w_bytes: int = 2, x_tiles: int = 1) -> int:
        """One pipeline stage: a weight tile (`w_bytes` per value) and `x_tiles` 16-bit x tiles (2 with
        SwiGLU: gate and up)."""
        return (self.block_n * w_bytes + x_tiles * BLOCK_M * 2) * self.block_k

    def smem_bytes(self, w_bytes: int = 2) -> int:
        """Pipeline buffers: num_stages weight tiles (`w_bytes` per value) and 16-bit x tiles."""
        return self.num_stages * self.stage_bytes(w_bytes)


# Per (N, K) on the reference device (`devices.tuned`), chosen by reasoning and checked by compiling
# for sm_90 (wgmma, cp.async pipeline, no spills), not yet timed: `benchmarks/kernels/gemv.py --sweep`
# times the alternatives on the device. The rules: wgmma-sized tiles (BLOCK_N ≥ 64, 4 warps);
# pipeline buffers ≤ 113 KB so ≥ 2 programs share an SM; a grid no larger than what is resident at
# once (2-3 per SM), so every program streams from the start and they finish together with no
# second-wave tail; split-K only where N alone gives too few tiles. Other devices take
# `_heuristic_config`, the same rules on their SM count, with the stages that fit their shared memory.
GEMV_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    # Qwen3-8B
    (6144, 4096): GemvConfig(64, 128, split_k=2, num_stages=4),  # qkv: 192 programs, 16 blocks each, 80 KB
    (4096, 4096): GemvConfig(64, 128, split_k=4, num_stages=4),  # o_proj: 256 programs, 8 blocks, 80 KB
    (24576, 4096): GemvConfig(64, 128, split_k=1, num_stages=3),  # gate_up: 384 programs, 3 per SM, 60 KB
    # down (usually with act="silu_mul"): BLOCK_N 128 halves the per-program SwiGLU recomputation.
    (4096, 12288): GemvConfig(128, 64, split_k=8, num_stages=5),  # 256 programs, 24 blocks, 92 KB (100 with SwiGLU)
    (151936, 4096): GemvConfig(128, 128, split_k=1, num_stages=3),  # lm_head: 1187 programs
    # Qwen3-30B-A3B (attention and lm_head; experts are not GEMVs)
    (5120, 2048): GemvConfig(64, 128, split_k=2, num_stages=4),  # qkv: 160 programs, 8 blocks
    (2048, 4096): GemvConfig(64, 128, split_k=8, num_stages=4),  # o_proj: 256 programs, 4 blocks
    (151936, 2048): GemvConfig(128, 128, split_k=1, num_stages=3),  # lm_head: 1187 programs
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fit(cfg: GemvConfig, spec: DeviceSpec, w_bytes: int = 2) -> GemvConfig:
    """`cfg` with as many of its stages as fit the device's shared memory per block, SwiGLU's second
    x tile counted (never fewer than 2)."""
    stages = devices.fit_stages(spec, cfg.num_stages, cfg.stage_bytes(w_bytes, x_tiles=2))
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


def _heuristic_config(n: int, k: int, spec: DeviceSpec) -> GemvConfig:
    """128-row tiles where they give 2 per SM, else 64; split-K doubling while the grid stays within
    2 programs per SM and every split keeps >= 4 K blocks."""
    sms = spec.sm_count
    block_k = next(b for b in (128, 64) if k % b == 0)
    k_blocks = k // block_k
    block_n = 128 if _cdiv(n, 128) >= 2 * sms else 64
    tiles = _cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= 2 * sms and k_blocks // (split * 2) >= 4:
        split *= 2
    return fit(GemvConfig(block_n, block_k, split, num_warps=4, num_stages=3 if block_n == 128 else 4), spec)


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> GemvConfig:
    """The configuration for weight [N, K] on `spec` (default: the current device): the table entry on
    the reference device, else the heuristic with the device's SM count and shared memory; a function
    of (N, K) only for a device, which is what makes the results independent of M."""
    spec = spec or devices.current()
    if devices.tuned(spec) and (n, k) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(n, k)]
    return _heuristic_config(n, k, spec)


def check_config(cfg: GemvConfig, k: int) -> None:
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(cfg.block_n) and pow2(cfg.block_k) and k % cfg.block_k == 0
            and 1 <= cfg.split_k <= k // cfg.block_k and cfg.num_warps in (1, 2, 4, 8) and cfg.num_stages >= 1):
        raise ValueError(f"invalid {cfg} for K={k}")


def gemv_supported(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the Triton path serves x [m, k] @ weight [n, k]ᵀ (k: the weight's K, also with silu_mul)."""
    return 1 <= m <= MAX_ROWS and n >= 1 and k >= 64 and k % 64 == 0 and dtype in SUPPORTED_DTYPES


def gemv_workspace_numel(n: int, k: int, config: GemvConfig | None = None, spec: DeviceSpec | None = None) -> int:
    """int32 elements of workspace for weight [N, K] (0 without split-K); one buffer serves any M ≤ 16.
    Several shapes share one sized by `shared_split_k_numel` of their `gemv_workspace_parts` (not by
    the largest of these: one shape's partials would overlap another's counters)."""
    cfg = config or gemv_config(n, k, spec)
    return split_k_numel(n, cfg.block_n, cfg.split_k, BLOCK_M)


def gemv_workspace_parts(n: int, k: int, config: GemvConfig | None = None,
                         spec: DeviceSpec | None = None) -> tuple[int, int]:
    """(counter slots, partial elements) of weight [N, K]'s workspace, for `shared_split_k_numel`."""
    cfg = config or gemv_config(n, k, spec)
    return split_k_parts(n, cfg.block_n, cfg.split_k, BLOCK_M)


def gemv_workspace(n: int, k: int, device, config: GemvConfig | None = None) -> torch.Tensor:
    """A zeroed workspace for weight [N, K]; the kernel leaves its counters at zero after each call."""
    return torch.zeros(gemv_workspace_numel(n, k, config, devices.current(device)), dtype=torch.int32,
                       device=device)


def _check_act(act: str | None) -> bool:
    if act not in (None, "silu_mul"):
        raise ValueError(f"act: expected None or 'silu_mul', got {act!r}")
    return act == "silu_mul"


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, *, act: str | None = None) -> torch.Tensor:
    if _check_act(act):
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


@jit
def _finish(acc, bias_ptr, scale_ptr, out_ptr, out_stride, cols, rows, col_ok, row_ok, HAS_BIAS: tl.constexpr,
            W8: tl.constexpr):
    if W8 != "":
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[None, :] * out_stride + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=col_ok[:, None] & row_ok[None, :])


# e4m3 → 16-bit for four values (one int32 word, bytes 0-3 in K order) per instance: each byte's
# exponent and mantissa bits, moved into the target's places, read as the value times 2^-120 (bf16)
# or 2^-8 (fp16), subnormals included (both biases count from the same point); the sign is or-ed
# back and one packed multiply by 2^120 / 2^8 undoes the factor, exactly (every e4m3 value is a normal
# bf16 and fp16). Bytes 1 and 3 sit in the high bytes of the word's halves; bytes 0 and 2 get there by
# a shift. Outputs: bytes 0, 2, 1, 3.
_E4M3_ASM = """{{
        .reg .b32 lo, hi, q8, mul, negzero;
        mov.b32 mul, {mul};
        mov.b32 negzero, 0x80008000;
        and.b32 hi, $4, 0x7F007F00;
        shr.b32 hi, hi, {shift};
        lop3.b32 hi, hi, $4, negzero, 0xF8;
        shl.b32 q8, $4, 8;
        and.b32 lo, q8, 0x7F007F00;
        shr.b32 lo, lo, {shift};
        lop3.b32 lo, lo, q8, negzero, 0xF8;
        fma.rn.{ty}x2 lo, lo, mul, negzero;
        fma.rn.{ty}x2 hi, hi, mul, negzero;
        mov.b32 {{$0, $1}}, lo;
        mov.b32 {{$2, $3}}, hi;
        }}"""
_E4M3_TO_BF16 = constexpr(_E4M3_ASM.format(mul="0x7B807B80", shift=4, ty="bf16"))
_E4M3_TO_F16 = constexpr(_E4M3_ASM.format(mul="0x5C005C00", shift=1, ty="f16"))


@jit
def _e4m3_byte(u, SHIFT: tl.constexpr, like):
    """The e4m3 value in bits [SHIFT, SHIFT + 8) of uint32 words, in the dtype of `like`: the bit moves
    of the PTX in fp32's places (value × 2^-120), then × 2^120."""
    v = (u >> SHIFT) & 0xFF
    f = (((v & 0x80) << 24) | ((v & 0x7F) << 20)).to(tl.float32, bitcast=True)
    return (f * 1.329227995784916e36).to(like.dtype)  # 2^120


@jit
def _e4m3_quads(q, like, ASM: tl.constexpr):
    """int32 words of four e4m3 values → the values of bytes 0, 2, 1, 3 as four tensors in the dtype
    of `like`, exactly: by the PTX above (bf16 / fp16 on the GPU), else by the same bit moves in fp32
    (portable: the interpreter, and a cross-check of the PTX on the GPU)."""
    dt = like.dtype
    if ASM:
        if dt == tl.bfloat16:
            return tl.inline_asm_elementwise(_E4M3_TO_BF16, "=h,=h,=h,=h,r", [q], dtype=(dt, dt, dt, dt),
                                             is_pure=True, pack=1)
        return tl.inline_asm_elementwise(_E4M3_TO_F16, "=h,=h,=h,=h,r", [q], dtype=(dt, dt, dt, dt),
                                         is_pure=True, pack=1)
    u = q.to(tl.uint32, bitcast=True)
    return _e4m3_byte(u, 0, like), _e4m3_byte(u, 16, like), _e4m3_byte(u, 8, like), _e4m3_byte(u, 24, like)


@jit
def _w8_dot(q, xt, acc, ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
            IEEE_DOT: tl.constexpr):
    """acc + the tile's products for e4m3 words q [BLOCK_N, BLOCK_K / 4] and xᵀ [BLOCK_K, BLOCK_M]. The
    dot takes K in any order consistent between its operands: even k (bytes 0 and 2 of each word) in
    one dot and odd k in another, so each word becomes two 16-bit pairs in registers that are already
    the MMA's operand pairs (no shuffles), and x is split the same way."""
    if IEEE_DOT:  # products of e4m3 and 16-bit values are exact in fp32
        xt = xt.to(tl.float32)
    w0, w2, w1, w3 = _e4m3_quads(q, xt, ASM)
    w_even = tl.reshape(tl.join(w0, w2), [BLOCK_N, BLOCK_K // 2])
    w_odd = tl.reshape(tl.join(w1, w3), [BLOCK_N, BLOCK_K // 2])
    x_even, x_odd = tl.split(tl.permute(tl.reshape(xt, [BLOCK_K // 2, 2, BLOCK_M]), [0, 2, 1]))
    if IEEE_DOT:
        acc = tl.dot(w_even, x_even, acc, input_precision="ieee")
        return tl.dot(w_odd, x_odd, acc, input_precision="ieee")
    acc = tl.dot(w_even, x_even, acc)
    return tl.dot(w_odd, x_odd, acc)


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, w_ptr, scale_ptr, bias_ptr, out_ptr, out_stride, partial_ptr, counter_ptr,
                 m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 IEEE_DOT: tl.constexpr, USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr,
                 W8: tl.constexpr = ""):
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    k_blocks = k // BLOCK_K
    kb_begin = split * k_blocks // SPLIT_K
    kb_end = (split + 1) * k_blocks // SPLIT_K
    pdl_prologue(USE_PDL)

    offs_n = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    offs_k = kb_begin * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tile * BLOCK_N + offs_n
    col_ok = cols < n
    row_ok = rows < m
    # The tile's base in int64 (an lm_head has N*K near 2^31); offsets inside a tile stay int32.
    if W8 == "":
        w_ptrs = w_ptr + (tile * BLOCK_N).to(tl.int64) * k + offs_n[:, None] * k + offs_k[None, :]
    else:  # read as int32 words of four e4m3 values (16-byte loads), K / 4 of them per row
        words = w_ptr.to(tl.pointer_type(tl.int32))
        offs_w = kb_begin * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
        w_ptrs = words + (tile * BLOCK_N).to(tl.int64) * (k // 4) + offs_n[:, None] * (k // 4) + offs_w[None, :]
    xt_ptrs = x_ptr + rows[None, :] * x_stride + offs_k[:, None]  # xᵀ tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(kb_begin, kb_end):
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        if SILU_MUL:
            gate = tl.load(xt_ptrs, mask=row_ok[None, :], other=0.0).to(tl.float32)
            up = tl.load(xt_ptrs + k, mask=row_ok[None, :], other=0.0).to(tl.float32)
            if USE_LIBDEVICE:
                e = libdevice.exp(-gate)
            else:
                e = tl.exp(-gate)
            silu = tl.div_rn(gate, 1.0 + e).to(x_ptr.dtype.element_ty).to(tl.float32)
            xt = (silu * up).to(x_ptr.dtype.element_ty)
        else:
            xt = tl.load(xt_ptrs, mask=row_ok[None, :], other=0.0)
        if W8 != "":
            acc = _w8_dot(w, xt, acc, W8 == "asm", BLOCK_N, BLOCK_K, BLOCK_M, IEEE_DOT)
            w_ptrs += BLOCK_K // 4
        else:
            if IEEE_DOT:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
            w_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K

    if SPLIT_K == 1:
        _finish(acc, bias_ptr, scale_ptr, out_ptr, out_stride, cols, rows, col_ok, row_ok, HAS_BIAS, W8)
    else:
        last, total = split_k_reduce(acc, partial_ptr, counter_ptr, tile, split, rows, offs_n, row_ok,
                                     SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            _finish(total, bias_ptr, scale_ptr, out_ptr, out_stride, cols, rows, col_ok, row_ok, HAS_BIAS, W8)


W8_CONVERSIONS = ("asm", "int")  # how the GPU turns e4m3 words into 16-bit values (`_e4m3_quads`)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, *, act: str | None = None, workspace: torch.Tensor | None = None,
                config: GemvConfig | None = None, scale: torch.Tensor | None = None,
                w8_conversion: str = "asm") -> torch.Tensor:
    """x [M ≤ 16, K] (or [M, 2K] with act="silu_mul"; contiguous rows, any row stride), weight [N, K]
    contiguous, bias [N] or None → out [M, N] in x's dtype. `workspace`: see `gemv_workspace`; without
    one a split-K shape allocates a zeroed one per call. `config` overrides `gemv_config(N, K)`.
    With `scale` (fp32 [N]) the weight is e4m3 and out = (x @ weightᵀ) · scale (module docstring);
    `w8_conversion` picks the GPU's e4m3 → 16-bit conversion, for comparing the two (same bits)."""
    silu_mul = _check_act(act)
    if x.dim() != 2 or weight.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x [M, K] with contiguous rows and a contiguous weight [N, K] expected, got x "
                         f"{tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)} strides {weight.stride()}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    w_dtype = x.dtype if scale is None else torch.float8_e4m3fn
    if x.shape[1] != (2 * k if silu_mul else k) or weight.dtype != w_dtype or m > MAX_ROWS:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}"
                         f"{' with silu_mul' if silu_mul else ''} (M ≤ {MAX_ROWS})")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias: expected contiguous [{n}], got {tuple(bias.shape)}")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous()
                              or w8_conversion not in W8_CONVERSIONS):
        raise ValueError(f"scale: expected contiguous fp32 [{n}], got {tuple(scale.shape)} {scale.dtype} "
                         f"(w8_conversion {w8_conversion!r} of {W8_CONVERSIONS})")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out: expected [{m}, {n}] {x.dtype} with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    cfg = config or gemv_config(n, k, devices.current(x))
    check_config(cfg, k)
    if scale is not None and cfg.block_k < 64:
        raise ValueError(f"{cfg}: e4m3 weights need block_k >= 64 (16 words of four values per row)")
    if m == 0 or n == 0:
        return out
    tiles = _cdiv(n, cfg.block_n)
    counters = partials = out  # placeholders: never touched without split-K
    if cfg.split_k > 1:
        counters, partials = split_k_views(workspace, n, cfg.block_n, cfg.split_k, BLOCK_M, x.device)
    w8 = "" if scale is None else "int" if x.dtype == torch.float32 or not x.is_cuda else w8_conversion
    on = use_pdl(x)
    _gemv_kernel[(tiles * cfg.split_k,)](
        x, x.stride(0), weight, weight if scale is None else scale, weight if bias is None else bias, out,
        out.stride(0), partials, counters, m, n, k, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, EVEN_N=n % cfg.block_n == 0, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        IEEE_DOT=x.dtype == torch.float32 or (w8 != "" and not x.is_cuda), USE_LIBDEVICE=x.is_cuda, USE_PDL=on,
        W8=w8, launch_pdl=on, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         *, act: str | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for CUDA shapes it serves; elsewhere on CUDA cuBLAS in x's dtype (F.linear, not
    batch invariant), and the reference off CUDA."""
    silu_mul = _check_act(act)
    if (use_triton(x) and x.dim() == 2 and weight.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
            and weight.dtype == x.dtype and gemv_supported(x.shape[0], weight.shape[0], weight.shape[1], x.dtype)):
        return gemv_triton(x, weight, bias, out, act=act, workspace=workspace)
    if not x.is_cuda:
        return gemv_ref(x, weight, bias, out, act=act)
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)
