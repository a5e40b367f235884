"""Batch-invariant GEMM over weights kept quantized (Q8_0, FP8): out [M, N] = x [M, K] @ Wᵀ (+ bias),
for any M ≥ 1, a row's bits the same whatever other rows are computed with it (`--batch-invariant`
with `--keep-quantized` Q8_0 files or `--quantize fp8`).

It is the construction of `strata.kernels.matmul` (its docstring says why a row cannot depend on M:
K cut into ranges fixed by the weight's shape, `matmul.invariant_split_k`, each summed from zero in K
order and the range sums added in range order; BLOCK_K fixed, M unspecialised, the configuration
varying with M only in tile sizes, warps and stages), with the weight tile decoded in registers. At
decode sizes (M ≤ BLOCK_M) each range is a program of its own and the last to arrive adds the ranges'
sums (`strata.kernels.splitk`); longer launches walk the ranges one after another in each program:
the same additions in the same order. Ranges are whole BLOCK_K = 64 blocks (two Q8_0 groups), cut
as matmul cuts them, a K tail in the last. Per format:
- FP8 (e4m3 [N, K], one fp32 scale per output channel): the tile becomes x's dtype exactly (every
  e4m3 value is a bf16 and an fp16) and the MMA chains the fp32 accumulator, `acc = tl.dot(a, wᵀ,
  acc)`, over BLOCK_K = 64 in K order, as the bf16 GEMM does; the epilogue multiplies the sum by the
  channel's scale and adds the bias in one FMA, then rounds once to x's dtype.
- Q8_0 (int8 quants [N, K], an fp16 scale per 32 values): the scale changes every 32 values of K, so
  each 32-value group has its own MMA from zero, `part = tl.dot(a, qᵀ)` (fp32; the quants in x's
  dtype, exactly), and one FMA per output adds it, `acc = fma(part, d, acc)`, group after group in K
  order, from zero again at each range. A K step holds two groups (BLOCK_K = 64: the step's scales
  are then 4 contiguous bytes a weight row, which the pipeliner copies asynchronously; one group's 2
  bytes it would load in the loop); the arithmetic is that of one group per step. The weight is
  never rounded to x's dtype (the format's own kernels round d·q to it), so the result is also
  closer to the fp32 reference.
  The explicit FMA (not `acc + part * d`) keeps the compiler from contracting, or not, differently
  in the binaries of different configurations.
- fp32 x: the "ieee" dot (an FMA chain in K order). Under the interpreter 16-bit x takes it too: its
  16-bit dot is not the GPU's, so the decoded 16-bit operands are widened (exactly) first; the CPU
  tests then check the decoding and the order of the sums, only the MMA instruction differs.

Configurations (`q_config`): `matmul.invariant_config`'s tiles, warps, stages and K ranges, except
that Q8_0 leaves out tiles whose accumulator takes more than 64 fp32 registers a thread (256x128 and
128x256 on 8 warps): its `part` doubles that. fp32 on CUDA: one FMA configuration for every M. Reasoned,
not timed (`python benchmarks/kernels/quant_invariant.py` times them against the formats' own kernels and
cuBLAS). Decode-sized launches take a workspace (`invariant_q_workspace_parts`).

Semantics (`matmul_invariant_q_ref`, what the CPU engine runs): the weight dequantized to fp32
(`QWeight.dequantize`, exact for both formats), `strata.kernels.invariant.linear` (rows padded: a
row's fp32 result does not depend on M on the CPU either), rounded once to x's dtype. The kernels
differ from it by fp32 summation order (and FP8's scale applied after the sum) and the final rounding.

PDL prologue first, launched with `launch_pdl`. CUDA graphs: grid and configuration come from shapes,
nothing is read back, nothing is allocated except `out` and a workspace when none is given (a
`QWeightStack` writes each part into its columns of that one output, its launches one after another
sharing a given workspace).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from strata.kernels import device as devices
from strata.kernels import invariant as k_invariant
from strata.kernels import kernels_run, use_pdl
from strata.kernels.device import DeviceSpec
from strata.kernels.matmul import (
    BLOCK_K,
    DECODE_MAX_M,
    FP32_CONFIG,
    MatmulConfig,
    _matmul_kernel,
    check_config,
    decode_config,
    invariant_config,
    invariant_split_k,
    min_tiles,
    wide_configs,
)
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant import QWeight, QWeightStack
from strata.kernels.splitk import split_k_parts, split_k_reduce, split_k_views
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


FORMATS = ("Q8_0", "FP8")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Q8_0_MAX_ACC_REGS = 64  # fp32 accumulator registers a thread that leave room for `part` beside it


def supports(weight) -> bool:
    """Whether `matmul_invariant_q` takes this weight: a Q8_0 or FP8 `QWeight`, or a `QWeightStack`
    of such parts (formats may mix)."""
    if isinstance(weight, QWeightStack):
        return all(supports(p) for p in weight.parts)
    return isinstance(weight, QWeight) and weight.ggml_type in FORMATS


def _acc_regs(cfg: MatmulConfig) -> int:
    return cfg.block_m * cfg.block_n // (32 * cfg.num_warps)


def q_config(ggml_type: str, m: int, n: int, k: int, dtype: torch.dtype, on_cuda: bool,
             spec: DeviceSpec | None = None) -> MatmulConfig:
    """The configuration of x [m, k] @ Wᵀ for a weight in `ggml_type` (module docstring) on `spec`
    (default: the current device). Varies with m only in tile sizes, warps, stages and program order;
    BLOCK_K is 64 (FP8 in fp32 on CUDA: the FMA configuration's, one for every M, whose chain no
    BLOCK_K reorders) and the K ranges are `invariant_split_k(n, k)`, whatever m."""
    spec = spec or devices.current()
    split = invariant_split_k(n, k, spec)
    if dtype == torch.float32 and on_cuda:
        return replace(FP32_CONFIG, block_k=BLOCK_K if ggml_type == "Q8_0" else FP32_CONFIG.block_k, split_k=split)
    if ggml_type != "Q8_0":
        return invariant_config(m, n, k, spec)
    if m > DECODE_MAX_M:
        for cfg in wide_configs(spec):
            if _acc_regs(cfg) <= Q8_0_MAX_ACC_REGS and cfg.tiles(m, n) >= min_tiles(spec):
                return replace(cfg, block_k=BLOCK_K, split_k=split)
    return replace(decode_config(n, spec), block_k=BLOCK_K, split_k=split)


def invariant_q_workspace_parts(weight) -> tuple[int, int]:
    """(counter slots, partial elements) of the workspace that decode-sized launches on `weight` (one
    `supports` takes) need, for `shared_split_k_numel`: the largest of its parts' (a stack's parts
    launch one after another), in 16-bit and in fp32 on CUDA. A 16-bit QWeight [n, k] needs what
    `matmul.invariant_workspace_parts(n, k)` gives: the same decode tile and K ranges."""
    parts = weight.parts if isinstance(weight, QWeightStack) else (weight,)
    sizes = [split_k_parts(p.n, c.block_n, c.split_k, c.block_m) for p in parts for c in
             (q_config(p.ggml_type, 1, p.n, p.k, dtype, True) for dtype in (torch.bfloat16, torch.float32))]
    return max(c for c, _ in sizes), max(e for _, e in sizes)


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _int8_to(q, dtype: tl.constexpr):
    """int8 quants → `dtype`, exactly: q + 128 in [0, 255] ORed into the mantissa of 2^23, less
    2^23 + 128, is q in fp32 with integer ops and one add (an int → float conversion issues at a
    quarter of their rate); every int8 is a bf16 and an fp16."""
    u = q.to(tl.int32) + 128
    return ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0).to(dtype)


@jit
def _q8_0_group(a, q, d, acc, IEEE_DOT: tl.constexpr):
    """acc + d · (a @ qᵀ) for one 32-value group: a [BLOCK_M, 32] in x's dtype, q [BLOCK_N, 32] int8,
    d [BLOCK_N] fp32. The group's MMA starts from zero; one FMA adds it (module docstring)."""
    w = _int8_to(q, a.dtype)
    if IEEE_DOT:
        part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(w))
    return tl.fma(part, d[None, :], acc)


@jit
def _store(acc, out_ptr, out_stride, rows, cols, row_ok, col_ok):
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@jit
def _q8_0_range_sum(x_ptr, x_stride, qs_ptr, d_ptr, rows, cols, row_ok, col_ok, k, k_groups, step_start, step_end,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, IEEE_DOT: tl.constexpr):
    """x[rows] @ W[cols]ᵀ over the 64-value K steps [step_start, step_end), from zero, in K order."""
    offs = tl.arange(0, 32)
    pair = tl.arange(0, 2)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + step_start * 64 + offs[None, :]
    q_ptrs = qs_ptr + cols.to(tl.int64)[:, None] * k + step_start * 64 + offs[None, :]
    d_ptrs = d_ptr + cols.to(tl.int64)[:, None] * k_groups + step_start * 2 + pair[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(step_start, step_end):
        # K is a multiple of 32: a step's first group always exists, its second unless this is a tail.
        a0 = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        q0 = tl.load(q_ptrs, mask=col_ok[:, None], other=0)
        if EVEN_K:
            a1 = tl.load(x_ptrs + 32, mask=row_ok[:, None], other=0.0)
            q1 = tl.load(q_ptrs + 32, mask=col_ok[:, None], other=0)
            d = tl.load(d_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            in_k = kb * 64 + 32 + offs < k  # all or none: the second group's values
            a1 = tl.load(x_ptrs + 32, mask=row_ok[:, None] & in_k[None, :], other=0.0)
            q1 = tl.load(q_ptrs + 32, mask=col_ok[:, None] & in_k[None, :], other=0)
            d = tl.load(d_ptrs, mask=col_ok[:, None] & (kb * 64 + pair * 32 < k)[None, :], other=0.0)
        d0, d1 = tl.split(d.to(tl.float32))
        acc = _q8_0_group(a0, q0, d0, acc, IEEE_DOT)
        acc = _q8_0_group(a1, q1, d1, acc, IEEE_DOT)
        x_ptrs += 64
        q_ptrs += 64
        d_ptrs += 2
    return acc


@jit(do_not_specialize=["m"])
def _q8_0_kernel(x_ptr, x_stride, qs_ptr, d_ptr, bias_ptr, out_ptr, out_stride, partial_ptr, counter_ptr, m, n, k,
                 k_groups, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                 SPLIT_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_DOT: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """SPLIT_PROGRAMS (one row tile): program (column tile, range) sums its range of 64-value steps and
    the last to arrive adds the ranges' sums in order (`split_k_reduce`). Otherwise each program walks
    every range itself and adds their sums in the same order: the same bits either way."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    if SPLIT_PROGRAMS:
        tile_m, tile_n, split = 0, pid // SPLIT_K, pid % SPLIT_K
    else:
        tile_m, tile_n = grouped_tile(pid, m, n, BLOCK_M, BLOCK_N, GROUP_M)
        split = 0
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    steps = tl.cdiv(k, 64)
    store = True
    if SPLIT_PROGRAMS:
        part = _q8_0_range_sum(x_ptr, x_stride, qs_ptr, d_ptr, rows, cols, row_ok, col_ok, k, k_groups,
                               split * steps // SPLIT_K, (split + 1) * steps // SPLIT_K, BLOCK_M, BLOCK_N, EVEN_K,
                               IEEE_DOT)
        store, total_t = split_k_reduce(tl.trans(part), partial_ptr, counter_ptr, tile_n, split, rows,
                                        tl.arange(0, BLOCK_N), row_ok, SPLIT_K, BLOCK_M, BLOCK_N)
        acc = tl.trans(total_t)
    else:
        acc = _q8_0_range_sum(x_ptr, x_stride, qs_ptr, d_ptr, rows, cols, row_ok, col_ok, k, k_groups, 0,
                              steps // SPLIT_K, BLOCK_M, BLOCK_N, EVEN_K, IEEE_DOT)
        for s in tl.static_range(1, SPLIT_K):
            acc += _q8_0_range_sum(x_ptr, x_stride, qs_ptr, d_ptr, rows, cols, row_ok, col_ok, k, k_groups,
                                   s * steps // SPLIT_K, (s + 1) * steps // SPLIT_K, BLOCK_M, BLOCK_N, EVEN_K, IEEE_DOT)
    if store:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        _store(acc, out_ptr, out_stride, rows, cols, row_ok, col_ok)


# ----------------------------------------------------------------------------------------------
# Public ops


def _check_args(x: torch.Tensor, weight, bias: torch.Tensor | None, out: torch.Tensor | None,
                flat: bool) -> tuple[int, int, int]:
    if not supports(weight):
        raise ValueError(f"batch-invariant quantized GEMM: {getattr(weight, 'ggml_type', type(weight).__name__)} "
                         f"weights are not covered (formats: {', '.join(FORMATS)})")
    n, k = weight.n, weight.k
    two_d = x.dim() == 2 and x.stride(1) == 1
    if (flat and not two_d) or x.shape[-1] != k or x.dtype not in SUPPORTED_DTYPES or x.device != weight.device:
        raise ValueError(f"x: expected [M, {k}] bf16/fp16/fp32{' with contiguous rows' if flat else ''} on "
                         f"{weight.device}, got {tuple(x.shape)} {x.dtype} strides {x.stride()} on {x.device}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous() or bias.device != x.device):
        raise ValueError(f"bias: expected contiguous [{n}] on {x.device}, got {tuple(bias.shape)}")
    m = x.numel() // k if k else 0
    if out is not None and (tuple(out.shape) != (*x.shape[:-1], n) or out.dtype != x.dtype or out.stride(-1) != 1
                            or out.device != x.device):
        raise ValueError(f"out: expected {(*x.shape[:-1], n)} {x.dtype} with contiguous rows on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")
    return m, n, k


def matmul_invariant_q_ref(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition (module docstring): x [..., K] @ dequantize(W)ᵀ (+ bias) in fp32 with the rows
    padded (`strata.kernels.invariant.linear`), rounded once to x's dtype. Row-invariant on the CPU."""
    _check_args(x, weight, bias, out, flat=False)
    y = k_invariant.linear(x.float(), weight.dequantize(), None if bias is None else bias.float()).to(x.dtype)
    return y if out is None else out.copy_(y)


def _launch(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None, out: torch.Tensor,
            config: MatmulConfig | None, workspace: torch.Tensor | None) -> None:
    m, n, k = x.shape[0], w.n, w.k
    cfg = config or q_config(w.ggml_type, m, n, k, x.dtype, x.is_cuda, devices.current(x))
    check_config(cfg, x.dtype)
    if w.ggml_type == "Q8_0" and cfg.block_k != 64:
        raise ValueError(f"{cfg}: the Q8_0 kernel steps 64 values of K (two groups) at a time")
    split_programs = cfg.split_k > 1 and m <= cfg.block_m
    counters = partials = out  # placeholders, untouched without split programs
    if split_programs:
        counters, partials = split_k_views(workspace, n, cfg.block_n, cfg.split_k, cfg.block_m, x.device)
    on = use_pdl(x)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k,
                  SPLIT_PROGRAMS=split_programs, HAS_BIAS=bias is not None,
                  IEEE_DOT=x.dtype == torch.float32 or not x.is_cuda, USE_PDL=on, launch_pdl=on,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    bias_arg = bias if bias is not None else out  # a placeholder, never read without HAS_BIAS
    grid = (-(-n // cfg.block_n) * cfg.split_k if split_programs else cfg.tiles(m, n),)
    if w.ggml_type == "Q8_0":
        qs, d = w.planes["qs"], w.planes["d"]
        _q8_0_kernel[grid](x, x.stride(0), qs, d, bias_arg, out, out.stride(0), partials, counters, m, n, k, k // 32,
                           EVEN_K=k % BLOCK_K == 0, **common)
    else:
        # The dense GEMM's kernel: e4m3 tiles become x's dtype exactly, the scale applied to the sum.
        _matmul_kernel[grid](x, x.stride(0), w.planes["w"], w.planes["scale"], bias_arg, out, out.stride(0),
                             partials, counters, m, n, k, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
                             HAS_SCALE=True, **common)


def matmul_invariant_q_triton(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                              out: torch.Tensor | None = None, *, config: MatmulConfig | None = None,
                              workspace: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1). `config` overrides `q_config` for
    every part (tests, benchmarks): a row is then only as invariant as the configurations compared, K
    ranges (`split_k`) included. `workspace`: int32, at least `invariant_q_workspace_parts`' sum for
    this weight (split ranges at decode sizes; None allocates one per launch that needs it,
    `split_k_views`); each launch leaves its counters at zero."""
    m, n, _ = _check_args(x, weight, bias, out, flat=True)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    parts = weight.parts if isinstance(weight, QWeightStack) else (weight,)
    c = 0
    for p in parts:
        _launch(x, p, None if bias is None else bias[c : c + p.n], out[:, c : c + p.n], config, workspace)
        c += p.n
    return out


def matmul_invariant_q(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32; contiguous rows, any row stride) @ Wᵀ (+ bias [N]) for a weight
    `supports` accepts → [M, N] in x's dtype (into `out` when given: contiguous rows). Row i is bitwise
    the same for any M and any other rows. The kernels on CUDA (no gradient) and in the interpreter
    (`workspace` as `matmul_invariant_q_triton` takes it), `matmul_invariant_q_ref` elsewhere."""
    if kernels_run(x, _q8_0_kernel):
        return matmul_invariant_q_triton(x, weight, bias, out, workspace=workspace)
    return matmul_invariant_q_ref(x, weight, bias, out)
