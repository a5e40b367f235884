"""Stream-K scheduling of the Q8_0 prompt GEMM, and the scratch context its fix-ups live in.

Why. The tiled GEMM of `q8_0.py` gives each program one output tile; when the tile count is not a
multiple of the SM count the last wave runs part-empty (M = 512, N = 4096 in 128 x 128 tiles: 128
tiles on 132 SMs), so it picks smaller, less efficient tiles instead. Stream-K (Osama et al., 2023)
keeps the large tile and splits the work itself: a persistent grid of P programs (one per SM)
divides the T = tiles x K-blocks (tile, K-block) iterations evenly, worker w taking the range
[w*T//P, (w+1)*T//P) in tile-major order. A tile whose K-blocks all fall in one range is stored
directly; a tile cut by a range boundary is shared, and each worker has at most one unfinished piece
(the one its range ends in), so one fix-up slot per worker suffices.

Fix-up, in the kernel, deterministic. The worker that computes a shared tile's LAST K-block owns it:
every other sharer writes its fp32 partial tile into its own slot of the context's pool and raises
its flag; the owner waits for the sharers' flags one by one in worker order and adds their partials
to its own accumulator in that order, then stores the tile, rounded once. The order depends on
(shapes, P) only, never on arrival, so the bits are identical run to run (for a given P). Each
worker walks its tiles in DESCENDING order: its unfinished piece (the first K-blocks of its last
tile) is computed and published first, and the piece it owns (its first tile's K tail) comes last,
when the partials it needs were published long ago: owners rarely wait at all.

No deadlock: an owner waits only on lower workers, so the waits form no cycle, and every lower worker
is running or done. When a launch has shared tiles, the CTAs take their worker numbers from a ticket
counter rather than from the block index, so a lower worker number belongs to a CTA that has already
started (no reliance on the hardware dispatching blocks in index order, nor on co-residency with
other streams' kernels); and P <= #SMs programs of one CTA each are co-resident anyway, with PDL
dependents unable to take SMs before every one of our CTAs has started and run
`griddepcontrol.launch_dependents`. Triton's interpreter runs programs one by one in increasing
order, so there every flag an owner checks is already up. The alternative, a second launch summing
the partials, needs no flags but costs a launch and a dependency bubble (several us, more than the
fix-up itself) and cannot overlap the fix-up with the other workers' main loops.

Zeroing. A launch with shared tiles needs its flag words and ticket counter zero at launch; the
partial slots need nothing (each is written in full before its flag goes up). The pool is allocated
zeroed (`torch.zeros`, only when it grows) and every launch leaves those words as it found them: the
owner's compare-and-swap that sees a flag at 1 sets it back to 0 (every raised flag has exactly one
owner), and the last ticket taker resets the counter. So no memset and no extra launch per call.
Anyone else taking bytes from the pool must likewise leave its first FLAG_BYTES bytes zero. A
context serves one stream at a time (two launches in flight on it would share slots).

Pool layout for a launch of P programs and BLOCK_M x BLOCK_N tiles, when any tile is shared:
[0, FLAG_BYTES) int32 words (the ticket counter, then P flags; the region's size and place never
depend on P or the tile, so the words a launch needs zero are never another launch's partial slots),
then P slots of BLOCK_M x BLOCK_N fp32. A launch with no shared tile touches no pool byte, needs none.

Semantics are `q8_0.matmul`'s: each weight d*q exact in fp32, rounded to nearest even to x's dtype
(bf16 / fp16; none for fp32 x), fp32 accumulation, the result rounded once to x's dtype. Only the
fp32 summation order differs (a shared tile's K range is summed in pieces). Nothing is read back to
the host; the grid is (P,), from shapes and the device; with the pool reserved beforehand
(`reserve_fixup(QMatmulContext.largest_fixup(P))`) a launch allocates nothing but `out` when None,
so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from strata.kernels import device as devices
from strata.kernels import kernels_run, use_pdl
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.q8_0 import (SUPPORTED_DTYPES, Q8Config, _block_k, _cdiv, _check_planes, check_config,
                                       fit_gemm, matmul_ref, q8_tile_product)
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


FLAG_BYTES = 4096  # the pool's head: int32 ticket counter + one flag per program, for any launch
MAX_PROGRAMS = FLAG_BYTES // 4 - 1
INTERPRETER_PROGRAMS = 3  # default P under TRITON_INTERPRET: several programs, shared tiles, quick


class QMatmulContext:
    """Scratch of the quantized read GEMMs on one device (and one stream): a uint8 pool that starts
    empty and is reallocated, zeroed, to exactly the requested size only when a launch needs more
    than it holds (`grows` counts those reallocations). Reserve the largest need once
    (`reserve_fixup(QMatmulContext.largest_fixup(num_sms))`) and no later launch allocates: what
    CUDA-graph capture requires. Growing while the stream is being captured is refused."""

    def __init__(self, device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._pool = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self.grows = 0

    @property
    def pool_bytes(self) -> int:
        return self._pool.numel()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of the pool's first `nbytes`, growing the pool first if it is smaller. The bytes
        are those the previous user left (zero on a fresh allocation): see the module docstring for
        which ones the stream-K kernel relies on being zero, and how it keeps them so."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > self._pool.numel():
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"QMatmulContext needs {nbytes} bytes (has {self._pool.numel()}) during CUDA-graph "
                                   "capture: reserve_fixup(QMatmulContext.largest_fixup(...)) before capturing")
            self._pool = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self.grows += 1
        return self._pool[:nbytes]

    def reserve_fixup(self, nbytes: int) -> None:
        """Take `nbytes` and give them back: later launches needing at most that much allocate nothing."""
        self.take(nbytes)

    @staticmethod
    def largest_fixup(num_sms: int, block_m: int = 128, block_n: int = 128) -> int:
        """The most a stream-K launch of at most `num_sms` programs and such tiles can need: one fp32
        tile per program plus the flag region: num_sms * block_m * block_n * 4 + FLAG_BYTES (4096: an
        int32 ticket counter and up to MAX_PROGRAMS = 1023 int32 flags). 132 SMs, 128 x 128:
        8,650,752 + 4,096 = 8,654,848 bytes."""
        return num_sms * block_m * block_n * 4 + FLAG_BYTES


# ----------------------------------------------------------------------------------------------
# Schedule (host side: configuration, fix-up size)


def streamk_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                   spec: DeviceSpec | None = None) -> Q8Config:
    """The tile the stream-K GEMM keeps whatever the tile count: 128 x 128 over 8 warps with BLOCK_K
    128 and 3 stages (q8_0's large-M tile: 144 KB of x + quant stages and 32 KB of dequantized
    staging, one CTA per SM), 64 x 128 with BLOCK_K 64 over 4 warps up to M = 64 (less padding), in
    as many of those stages as fit `spec`'s shared memory (`q8_0.fit_gemm`; default: the current
    device). fp32 x: q8_0's FMA tile, 32 x 64 x 32 (a correctness path). Untimed."""
    if dtype == torch.float32:
        return Q8Config(32, 64, 32, num_warps=4, num_stages=2)
    spec = spec or devices.current()
    if m <= 64:
        return fit_gemm(Q8Config(64, 128, _block_k(k, 64), num_warps=4, num_stages=4), spec)
    return fit_gemm(Q8Config(128, 128, _block_k(k, 128), num_warps=8, num_stages=3), spec)


@lru_cache(maxsize=256)
def _has_shared_tile(tiles: int, k_iters: int, num_programs: int) -> bool:
    """Whether a range boundary p*T//P (0 < p < P) falls inside a tile's K-blocks."""
    total = tiles * k_iters
    return any(p * total // num_programs % k_iters for p in range(1, num_programs))


def fixup_bytes(m: int, n: int, k: int, config: Q8Config, num_programs: int) -> int:
    """Pool bytes a launch needs: 0 when every tile is finished by one program, else
    FLAG_BYTES + P fp32 tiles, with P = num_programs clamped to the iteration count."""
    tiles = _cdiv(m, config.block_m) * _cdiv(n, config.block_n)
    k_iters = k // config.block_k
    p = min(num_programs, tiles * k_iters)
    if p <= 1 or not _has_shared_tile(tiles, k_iters, p):
        return 0
    return FLAG_BYTES + p * config.block_m * config.block_n * 4


def default_programs(device: torch.device) -> int:
    """One program per SM on CUDA; INTERPRETER_PROGRAMS elsewhere."""
    if device.type == "cuda":
        return devices.current(device).sm_count
    return INTERPRETER_PROGRAMS


# ----------------------------------------------------------------------------------------------
# Kernel


@jit
def _q8_streamk_kernel(x_ptr, x_stride, qs_ptr, d_ptr, out_ptr, out_stride, flags_ptr, partials_ptr,
                       m, n, k, k_groups, num_programs, has_fixup,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    worker = tl.program_id(0)
    if has_fixup:
        # Work goes by ticket, not block index: a ticket's holder is running, so waiting on a lower
        # ticket never waits on a CTA not yet dispatched. The last taker resets the counter.
        worker = tl.atomic_add(flags_ptr, 1, sem="relaxed", scope="gpu")
        if worker == num_programs - 1:
            tl.atomic_xchg(flags_ptr, 0, sem="relaxed", scope="gpu")
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    k_iters = k // BLOCK_K
    total = tiles_m * tiles_n * k_iters
    start = (worker.to(tl.int64) * total // num_programs).to(tl.int32)
    end = ((worker + 1).to(tl.int64) * total // num_programs).to(tl.int32)
    first_tile = start // k_iters
    last_tile = (end - 1) // k_iters
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    for step in range(0, last_tile - first_tile + 1):
        tile = last_tile - step
        tile_iter0 = tile * k_iters
        kb0 = tl.maximum(start - tile_iter0, 0)
        kb1 = tl.minimum(end - tile_iter0, k_iters)
        tile_m, tile_n = grouped_tile(tile, m, n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = q8_tile_product(x_ptr, x_stride, qs_ptr, d_ptr, m, n, k, k_groups, tile_m, tile_n, kb0, kb1,
                              BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT)

        if kb1 < k_iters:
            # Not the tile's last K-block: publish the partial for the owner. The barrier orders every
            # thread's stores before the release, which one thread performs.
            tl.store(partials_ptr + worker * TILE + offs_m[:, None] * BLOCK_N + offs_n[None, :], acc)
            tl.debug_barrier()
            tl.atomic_xchg(flags_ptr + 1 + worker, 1, sem="release", scope="gpu")
        else:
            if kb0 > 0:
                # The sharers are the programs from the one whose range holds the tile's first K-block
                # up to worker - 1; their partials are added to this program's own in that order.
                first_sharer = (((tile_iter0 + 1).to(tl.int64) * num_programs - 1) // total).to(tl.int32)
                for sharer in range(first_sharer, worker):
                    # Wait for the flag and set it back to 0 for the next launch, in one operation.
                    while tl.atomic_cas(flags_ptr + 1 + sharer, 1, 0, sem="acquire", scope="gpu") != 1:
                        pass
                    # ".cg" reads L2, where the sharer's stores are, never a stale L1 line.
                    acc += tl.load(partials_ptr + sharer * TILE + offs_m[:, None] * BLOCK_N + offs_n[None, :],
                                   cache_modifier=".cg")
            out_rows = tile_m * BLOCK_M + offs_m
            cols = tile_n * BLOCK_N + offs_n
            tl.store(out_ptr + out_rows.to(tl.int64)[:, None] * out_stride + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=(out_rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Public op


def _check_operands(x: torch.Tensor, out: torch.Tensor | None, qs: torch.Tensor, n: int, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES or x.device != qs.device:
        raise ValueError(f"x: expected [M, {k}] bf16/fp16/fp32 with contiguous rows on {qs.device}, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()} on {x.device}")
    m = x.shape[0]
    if out is not None and (out.dim() != 2 or tuple(out.shape) != (m, n) or out.dtype != x.dtype
                            or out.stride(1) != 1 or out.device != x.device):
        raise ValueError(f"out: expected [{m}, {n}] {x.dtype} with contiguous rows on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")


def q8_0_matmul_streamk(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, ctx: QMatmulContext,
                        out: torch.Tensor | None = None, *, num_programs: int | None = None,
                        config: Q8Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32, contiguous rows, any row stride) @ Wᵀ -> out [M, N] in x's dtype
    (contiguous rows; allocated when None), stream-K scheduled over `num_programs` persistent programs
    (default: the SM count on CUDA, INTERPRETER_PROGRAMS in the interpreter; clamped to the number of
    (tile, K-block) iterations). Shared tiles are fixed up through `ctx`'s pool, grown first if this
    launch needs more than it holds. `config`: the tile (q8_0.Q8Config; group_m orders the tiles),
    default `streamk_config`. Off CUDA outside the interpreter, or with a gradient to track:
    q8_0.matmul_ref (unrounded weights), and ctx is untouched."""
    qs, d = _check_planes(planes, n, k)
    _check_operands(x, out, qs, n, k)
    if ctx.device != qs.device:
        raise ValueError(f"ctx is on {ctx.device}, the weights on {qs.device}")
    if num_programs is not None and not 1 <= num_programs <= MAX_PROGRAMS:
        raise ValueError(f"num_programs must be in [1, {MAX_PROGRAMS}], got {num_programs}")
    if not kernels_run(x, _q8_streamk_kernel):
        return matmul_ref(x, planes, n, k, out)
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or streamk_config(m, n, k, x.dtype, devices.current(x))
    check_config(cfg, k, gemv=False)
    iterations = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n) * (k // cfg.block_k)
    programs = min(num_programs or default_programs(x.device), iterations)
    need = fixup_bytes(m, n, k, cfg, programs)
    pool = ctx.take(need)
    flags = pool[:FLAG_BYTES if need else 0].view(torch.int32)
    partials = pool[FLAG_BYTES if need else 0:].view(torch.float32)
    on = use_pdl(x)
    _q8_streamk_kernel[(programs,)](
        x, x.stride(0), qs, d, out, out.stride(0), flags, partials, m, n, k, k // 32, programs, int(need > 0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FP32_DOT=x.dtype == torch.float32 or not x.is_cuda, USE_PDL=on, launch_pdl=on,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
