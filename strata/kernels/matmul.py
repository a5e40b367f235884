"""Batch-invariant dense GEMM: out [M, N] = x [M, K] @ weight [N, K]ᵀ (+ bias), for any M ≥ 1.

Semantics (`matmul_ref`): F.linear in fp32, rounded once to x's dtype. The kernel accumulates in
fp32 and rounds once, after the bias. The point is --batch-invariant's promise: a row's result is bitwise the
same whether it is computed alone, in a decode batch of 8 or inside a 16384-token prompt read, so a
request's greedy output never depends on what else the server runs. cuBLAS (torch.matmul) gives no
such promise: its algorithm and split-K change with M.

Why a row cannot depend on M, by construction:
- K is cut into S ranges fixed by the weight's shape (`invariant_split_k`, never by M; S = 1 while
  SPLIT_RANGES is off). Each range is summed from zero in one fixed order, block 0, 1, 2, ..., with
  the fp32 accumulator chained through `acc = tl.dot(a, b, acc)`: each MMA adds into the running
  sum. (`acc += tl.dot(a, b)` would round a partial sum of BLOCK_K products before adding it:
  the result would depend on BLOCK_K.) The S
  sums are then added in range order. At decode sizes the ranges are programs of their own (the last
  to finish adds them, `strata.kernels.splitk`); in longer launches one program walks them one after
  another: the same additions in the same order, so the same bits.
- Rows and columns of a tile are independent: a row's value never mixes with another row's, so
  BLOCK_M and BLOCK_N, and how full the tile is, cannot change it. Rows past M load as zeros and
  are never stored.
- `invariant_config(m, n, k)` may depend on M only through BLOCK_M, BLOCK_N, num_warps and
  num_stages (and the program order): BLOCK_K is 64 in every configuration, so even a K tail
  (K % 64 != 0, masked to zeros) is handled identically for every M.
- On Hopper every 16-bit configuration stays on wgmma (Triton's MMAv3 needs BLOCK_M % 64 == 0 and
  num_warps % 4 == 0, and never falls back to mma.sync m16n8k16 here): a tile is covered by
  m64 x n x k16 instructions, each output element gets the same sequence of k16 steps (k = 0-15,
  16-31, ... in order, accumulating into the same fp32 register), whatever BLOCK_M or BLOCK_N are.
- fp32 inputs use the "ieee" dot (input_precision="ieee"): FMA in K order per element, invariant for
  any tile (and what the CPU interpreter tests run; on CUDA fp32 uses FP32_CONFIG, FMA tiles that
  fit the registers).
- M is a runtime argument Triton does not specialise on (`do_not_specialize`), so M = 1 and M = 64
  run the same binary.

What only the device can confirm: configurations of different BLOCK_N (and num_warps) run wgmma
with different instruction N sizes (m64n32k16 at decode, m64n256k16 in long reads). Equality across
them relies on the tensor core computing one output element's k16 step the same way whatever the
instruction's N (the same products, summed in the same order, with the same alignment and rounding
into the accumulator). NVIDIA does not document this; the GPU test (rows of M = 1 ... 2048 against
the same rows inside an M = 4096 launch) decides it. If it fails, `invariant_config` returns
INVARIANT_FALLBACK, one configuration for every M: a one-line switch. (A middle road, should only
the N size matter: keep BLOCK_N and the warps along N fixed and vary BLOCK_M alone, which repeats
one instruction along M.)

Configurations (reasoned, not yet timed: `python benchmarks/kernels/matmul.py --sweep` times them).
- M ≤ 64 (decode, verification): weight-bandwidth bound. BLOCK_M = 64 (the wgmma minimum; rows past
  M cost shared-memory traffic, no HBM), BLOCK_N as large as still gives ≥ 2 (≥ 4 for BLOCK_N = 128)
  column tiles per SM, else 32 (Qwen3-8B: qkv 192, o and down 128, gate_up 384 at BLOCK_N = 64,
  lm_head 1187 at 128), and as many pipeline stages as keep every program resident at once (no
  second wave), at most 8: ~32 KB of weights in flight per SM. The split ranges multiply the programs
  up to about four an SM (qkv 2, o_proj and down 4, gate_up and the LM head 1): the H200 timed these
  projections at 0.78-0.92x the split-K decode GEMV without them.
- M > 64: compute bound as M grows. The largest of WIDE_CONFIGS (128x256 with 8 warps, 128x128,
  64x128, 64x64) that fits the device's shared memory and still makes ≥ `min_tiles` tiles (7/8 of
  its SMs), so the SMs stay busy; programs walk the tiles in
  GROUP_M-row groups so that a weight tile is read from HBM once and reused from L2.

PDL: `pdl_prologue` first, launched with `launch_pdl`. CUDA graphs: the grid and the configuration
come from shapes only, nothing is read back to the host, and nothing is allocated except `out` when
none is passed (and a split workspace when none is passed at decode sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from strata.kernels import device as devices
from strata.kernels import kernels_run, use_pdl
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.splitk import split_k_parts, split_k_reduce, split_k_views
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


BLOCK_K = 64  # every 16-bit configuration: the K tail is then handled the same way for every M
DECODE_MAX_M = 64  # one 64-row tile: the decode configuration
SMEM_RESERVE = 7 << 10  # of a block's shared memory, what the decode configuration leaves out of its plan
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SPLIT_K = 8
MIN_SPLIT_BLOCKS = 8  # K blocks per range at least, so that each range's pipeline fills
# Split K ranges are off. Measured on the H200 (`python benchmarks/kernels/matmul.py --sweep`, and
# bench/results/determinism_on_splitk_cuda.json): with them --batch-invariant's decode cost is 14.5% /
# 11.3% (batch 1 / 8) instead of 15.1% / 15.2%, but a long launch walks them with a second live fp32
# tile (the 256x128 one spills) and read costs are 60% / 54% instead of 20% / 31% (4K / 32K); and the
# qkv shape's two ranges miss bitwise equality on the device, cause not found. The kernels keep
# the ranges (explicit configurations, and the tests, turn them on) for a walk without that tile.
SPLIT_RANGES = False


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int  # rows per program: a multiple of 64 for 16-bit inputs on Hopper (wgmma)
    block_n: int  # columns per program, a power of two ≥ 16
    block_k: int = BLOCK_K
    num_warps: int = 4  # a multiple of 4 (whole warp groups) for wgmma
    num_stages: int = 4
    group_m: int = 8  # row tiles that walk the column tiles together (L2 reuse of weight tiles)
    split_k: int = 1  # K ranges summed apart, then added in range order (`invariant_split_k`)

    def tiles(self, m: int, n: int) -> int:
        return _cdiv(m, self.block_m) * _cdiv(n, self.block_n)

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * elem_bytes


# Largest first; `invariant_config` takes the first that fits and gives ≥ `min_tiles` tiles. 256x128 with two
# warp groups (each a 128x128 accumulator) led the H200 sweep (`python benchmarks/kernels/matmul.py
# --sweep`) at M ≥ 2048 on every projection, 7-9% ahead of the classic 128x256 tile (48 KB
# a stage) kept next; 128x128 uses two warp groups too, so each holds a 64x128 accumulator.
WIDE_CONFIGS = (
    MatmulConfig(256, 128, num_warps=8, num_stages=3),  # 144 KB
    MatmulConfig(128, 256, num_warps=8, num_stages=3),  # 144 KB
    MatmulConfig(128, 128, num_warps=8, num_stages=4),  # 128 KB
    MatmulConfig(64, 128, num_warps=4, num_stages=4),  # 96 KB, 2 programs an SM
    MatmulConfig(64, 64, num_warps=4, num_stages=6),  # 96 KB
)
# One configuration for every M, should different instruction N sizes round differently on the
# device: decode keeps 64 programs for a 4096-wide weight and long reads run 64x64 tiles, both slower
# than the per-M choice (the sweep times it).
INVARIANT_FALLBACK = MatmulConfig(64, 64, num_warps=4, num_stages=6)
# fp32 on CUDA (FMA dots, no tensor cores): tiles whose operands fit the registers; any tile gives
# the same bits there, so one configuration serves every M.
FP32_CONFIG = MatmulConfig(64, 64, block_k=32, num_warps=4, num_stages=2)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def min_tiles(spec: DeviceSpec) -> int:
    """The tiles a wide configuration must give on `spec`: all but an eighth of its SMs busy."""
    return spec.sm_count - spec.sm_count // 8


def decode_config(n: int, spec: DeviceSpec | None = None) -> MatmulConfig:
    """M ≤ 64: one 64-row tile; BLOCK_N as wide as still leaves enough programs to stream weights
    from every SM, and stages sized so that every program is resident at once (at most 3 an SM
    planned for: gate_up's 384; the lm_head's 1187 programs run in waves anyway), in the shared
    memory of `spec` (default: the current device) less SMEM_RESERVE (220 of the H200's 227 KB)."""
    spec = spec or devices.current()
    sms = spec.sm_count
    if _cdiv(n, 128) >= 4 * sms:
        block_n = 128
    elif _cdiv(n, 64) >= 2 * sms:
        block_n = 64
    else:
        block_n = 32
    per_sm = min(_cdiv(_cdiv(n, block_n), sms), 3)
    stage_bytes = (DECODE_MAX_M + block_n) * BLOCK_K * 2
    plan = spec.smem_per_block - SMEM_RESERVE
    stages = max(3, min(8, plan // per_sm // stage_bytes))
    return MatmulConfig(DECODE_MAX_M, block_n, num_warps=4, num_stages=stages)


def invariant_split_k(n: int, k: int, spec: DeviceSpec | None = None) -> int:
    """S, the number of K ranges a row of x @ weight [n, k]ᵀ is summed in: each range from zero in K
    order, then the S sums added in range order. From the weight's shape only, never M: decode runs
    the ranges as programs of their own (S times the programs of its column tiles, up to about four
    an SM: no split-K otherwise leaves qkv, o_proj and down with 128-192 programs for 132 SMs), and a
    longer launch walks the same ranges one after another inside each program, so both give the same
    bits. A power of two, at most MAX_SPLIT_K, each range at least MIN_SPLIT_BLOCKS blocks of K; 1
    while SPLIT_RANGES is off."""
    if not SPLIT_RANGES:
        return 1
    spec = spec or devices.current()
    tiles, blocks = _cdiv(n, decode_config(n, spec).block_n), _cdiv(k, BLOCK_K)
    split = 1
    while (split * 2 <= MAX_SPLIT_K and tiles * split * 2 <= 4 * spec.sm_count
           and blocks // (split * 2) >= MIN_SPLIT_BLOCKS):
        split *= 2
    return split


def wide_configs(spec: DeviceSpec) -> tuple[MatmulConfig, ...]:
    """WIDE_CONFIGS whose pipeline buffers fit `spec`'s shared memory per block."""
    return tuple(cfg for cfg in WIDE_CONFIGS if cfg.smem_bytes() <= spec.smem_per_block)


def invariant_config(m: int, n: int, k: int, spec: DeviceSpec | None = None) -> MatmulConfig:
    """The configuration of x [m, k] @ weight [n, k]ᵀ for 16-bit inputs. It may vary with m only in
    what leaves a row's reduction alone (tile height and width, warps, stages); BLOCK_K and the K
    ranges (`invariant_split_k`) are fixed by the weight. To run one tile for every M, return
    INVARIANT_FALLBACK (with the split) here. `spec`: the device (default: the current one), whose
    SM count sets `min_tiles` and whose shared memory bounds the wide tiles."""
    spec = spec or devices.current()
    split = invariant_split_k(n, k, spec)
    if m > DECODE_MAX_M:
        for cfg in wide_configs(spec):
            if cfg.tiles(m, n) >= min_tiles(spec):
                return replace(cfg, split_k=split)
    return replace(decode_config(n, spec), split_k=split)


def invariant_workspace_parts(n: int, k: int, spec: DeviceSpec | None = None) -> tuple[int, int]:
    """(counter slots, partial elements) of the workspace decode-sized launches on weight [n, k] take
    (`strata.kernels.splitk`; for `shared_split_k_numel`); (0, 0) without split ranges."""
    return split_k_parts(n, decode_config(n, spec).block_n, invariant_split_k(n, k, spec), DECODE_MAX_M)


def check_config(cfg: MatmulConfig, dtype: torch.dtype) -> None:
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    ok = pow2(cfg.block_m) and pow2(cfg.block_n) and pow2(cfg.block_k) and cfg.num_stages >= 1
    ok = ok and cfg.num_warps in (1, 2, 4, 8, 16) and cfg.group_m >= 1
    if dtype != torch.float32:  # wgmma on Hopper, for every 16-bit configuration (see the docstring)
        ok = ok and cfg.block_m % 64 == 0 and cfg.num_warps % 4 == 0
    ok = ok and 1 <= cfg.split_k <= MAX_SPLIT_K
    if not ok:
        raise ValueError(f"invalid {cfg} for {dtype}")


def matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return y if out is None else out.copy_(y)


@jit
def _k_range_sum(x_ptr, x_stride, w_ptr, rows, cols, row_ok, col_ok, k, kb_start, kb_end,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 IEEE_DOT: tl.constexpr):
    """x[rows] @ weight[cols]ᵀ over K blocks [kb_start, kb_end), from zero, in K order. A weight of
    another dtype (e4m3: `strata.kernels.quant.invariant`) becomes x's dtype first, exactly."""
    offs_k = kb_start * BLOCK_K + tl.arange(0, BLOCK_K)
    # int64 row offsets: an lm_head's output at long M passes 2^31 elements.
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + offs_k[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * k + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = kb * BLOCK_K + tl.arange(0, BLOCK_K) < k
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w = w.to(x_ptr.dtype.element_ty)
        # Chained: every MMA step adds into the running fp32 sum, in K order (the module docstring).
        if IEEE_DOT:  # fp32, or 16-bit widened exactly where a caller asks for FMA order
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@jit(do_not_specialize=["m"])
def _matmul_kernel(x_ptr, x_stride, w_ptr, scale_ptr, bias_ptr, out_ptr, out_stride, partial_ptr, counter_ptr,
                   m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr, EVEN_K: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    """SPLIT_PROGRAMS (one row tile): program (column tile, range) sums its K range and the last to
    arrive adds the ranges' sums in order (`split_k_reduce`). Otherwise each program walks every range
    itself and adds their sums in the same order: the same bits either way. HAS_SCALE: the sum times a
    per-column fp32 scale (an FP8 weight's, `strata.kernels.quant.invariant`), fused with the bias."""
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
    k_blocks = tl.cdiv(k, BLOCK_K)
    store = True
    if SPLIT_PROGRAMS:
        part = _k_range_sum(x_ptr, x_stride, w_ptr, rows, cols, row_ok, col_ok, k, split * k_blocks // SPLIT_K,
                            (split + 1) * k_blocks // SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT)
        store, total_t = split_k_reduce(tl.trans(part), partial_ptr, counter_ptr, tile_n, split, rows,
                                        tl.arange(0, BLOCK_N), row_ok, SPLIT_K, BLOCK_M, BLOCK_N)
        acc = tl.trans(total_t)
    else:
        acc = _k_range_sum(x_ptr, x_stride, w_ptr, rows, cols, row_ok, col_ok, k, 0, k_blocks // SPLIT_K,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT)
        for s in tl.static_range(1, SPLIT_K):
            acc += _k_range_sum(x_ptr, x_stride, w_ptr, rows, cols, row_ok, col_ok, k, s * k_blocks // SPLIT_K,
                                (s + 1) * k_blocks // SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT)
    if store:
        if HAS_SCALE:
            scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
            if HAS_BIAS:
                acc = tl.fma(acc, scale, tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :])
            else:
                acc = acc * scale
        elif HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_args(x, weight, bias, out):
    if x.dim() != 2 or weight.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x [M, K] with contiguous rows and a contiguous weight [N, K] expected, got x "
                         f"{tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype} "
                         f"(both bf16, fp16 or fp32)")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias: expected contiguous [{n}], got {tuple(bias.shape)}")
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1
                            or out.device != x.device):
        raise ValueError(f"out: expected [{m}, {n}] {x.dtype} with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    return m, n, k


def matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, config: MatmulConfig | None = None,
                  workspace: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1). `config` overrides the choice of
    `invariant_config` (benchmarks and tests); a row's bits are then only as invariant as the configs
    compared, K ranges (`split_k`) included. `workspace`: int32, at least `invariant_workspace_parts`'
    sum for this weight (split ranges at decode sizes; None allocates one, see `split_k_views`)."""
    m, n, k = _check_args(x, weight, bias, out)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if config is None:
        fp32_cuda = x.dtype == torch.float32 and x.is_cuda
        spec = devices.current(x)
        config = (replace(FP32_CONFIG, split_k=invariant_split_k(n, k, spec)) if fp32_cuda
                  else invariant_config(m, n, k, spec))
    check_config(config, x.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    split_programs = config.split_k > 1 and m <= config.block_m
    counters = partials = out  # placeholders, untouched without split programs
    if split_programs:
        counters, partials = split_k_views(workspace, n, config.block_n, config.split_k, config.block_m, x.device)
    grid = _cdiv(n, config.block_n) * config.split_k if split_programs else config.tiles(m, n)
    on = use_pdl(x)
    _matmul_kernel[(grid,)](
        x, x.stride(0), weight, weight, weight if bias is None else bias, out, out.stride(0), partials, counters,
        m, n, k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        SPLIT_K=config.split_k, SPLIT_PROGRAMS=split_programs, EVEN_K=k % config.block_k == 0,
        HAS_SCALE=False, HAS_BIAS=bias is not None, IEEE_DOT=x.dtype == torch.float32,
        USE_PDL=on, launch_pdl=on, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def matmul_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32; contiguous rows, any row stride), weight [N, K] contiguous in x's
    dtype, bias [N] or None → out [M, N] in x's dtype (written into `out` when given: [M, N] with
    contiguous rows). Row i of the result is bitwise the same for any M and any other rows (module
    docstring). Runs the kernel on CUDA (and under the interpreter), the reference elsewhere."""
    if kernels_run(x, _matmul_kernel):
        return matmul_triton(x, weight, bias, out, workspace=workspace)
    _check_args(x, weight, bias, out)
    return matmul_ref(x, weight, bias, out)
