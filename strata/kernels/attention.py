"""Paged attention over the KV pool: decode, speculative verify and prefill rows in one kernel.

Layout (shared with `strata/runner/paged_attention.py`): the step's query rows are flat, q [N, Hq, D],
sequence after sequence. Sequence r owns rows q_start[r] .. q_start[r] + q_len[r] - 1; its context is
ctx_len[r] tokens INCLUDING the new ones (their K/V are already in the pool). Query i of sequence r
sits at position ctx_len - q_len + i and sees key positions 0..itself. Key position t lives at slot
block_tables[r, t // block_size] * block_size + t % block_size of k_cache / v_cache [slots, Hkv, D];
int8 caches carry one fp32 scale per (slot, head) in k_scale / v_scale [slots, Hkv]. Sequences with
q_len 0 are padding and do nothing; output rows that belong to no sequence are never written.

The kernel (FlashAttention-2 / flash-decoding style): one program per (sequence, query tile, kv head,
split). A program holds the tile's queries for all G = Hq / Hkv heads of its kv head as one block of
BLOCK_M = BLOCK_Q * G rows, so each K/V tile is read once per group. It walks the keys in tiles of
`kv_tile` positions gathered through the block table, with an online softmax in fp32 (exp2, log2 e
folded into the scale); only the tiles that cross the causal diagonal or the context end are masked,
and tiles wholly past the query tile's last position are skipped. int8 tiles enter the dots as exact
bf16/fp16 integers: the K scale multiplies the score columns after QK^T and the V scale the
probabilities before PV, so no tile is rescaled element by element.

Splits. `num_splits` is the host's upper bound (the grid's third dimension); a sequence uses only
active = `active_splits(ctx_len, num_splits)` of them (at most cdiv(ctx_len, MIN_SPLIT_KEYS) and at most
max(FEW_SPLITS, cdiv(ctx_len, LONG_SPLIT_KEYS))), each cdiv(cdiv(ctx_len, active), kv_tile) key tiles
long, and the programs above its last non-empty split return at once. So a graph captured for the
longest context still gives a short context a few short splits. A query tile whose
keys span one split writes its output directly. Otherwise every program stores its unnormalised
partial result in the `SplitWorkspace`, then takes a ticket from the tile's arrival counter (an atomic
add with acquire/release order after a CTA barrier, so the partials of every finished program are
visible to the one that sees the last ticket); the last program merges the partials in the fixed order
0, 1, 2, ... — the same bits whichever program finishes last — writes the output and resets the counter
to 0 for the next call. Given an `lse` tensor, whichever program writes a row's output also writes its
log-sum-exp over the keys it saw (fp32, natural log), so attention over other keys can be merged in
(the host KV tier); the flag is a constexpr, so a launch without it compiles the kernel as before.
With `whole_context` (another constexpr) every row sees all ctx_len keys, as if it sat after them:
a prompt chunk over a host prefix streamed to the device, with no causal diagonal to mask.

Graph capture: the grid depends only on R, max_q_len, Hkv and num_splits (host ints); every length,
start and table entry is read by the kernel, so a captured launch replays with new values in the same
tensors. Nothing is read back to the host, no tuning runs at call time, and the counters are back at 0
after every complete launch.

Batch invariance (what holds, and what full invariance would still need): a row's math is per row;
within a regime (decode-sized or prompt-sized steps) the key tile is fixed and tile boundaries sit at
absolute multiples of it; the extra tiles a row may visit because of its neighbours in the query tile are fully masked
for it and are exact no-ops (p = 0, rescale by exp2(0) = 1). Split boundaries depend on ctx_len, the
key tile and active_splits(ctx_len, num_splits): whenever num_splits >= active_splits(ctx_len, ∞)
they depend on ctx_len alone, and a context of at most MIN_SPLIT_KEYS keys is never
split (same bits as num_splits = 1). So a row is independent of the batch when every launch passes
num_splits >= active_splits(longest context, ∞) (a batch-invariant mode: a fixed num_splits of
that size and a workspace to match; idle split programs cost one early return each), provided the
dot products of a row do not depend on the tile height BLOCK_M (true of fp32 "ieee" dots, which are
FMA loops over D). Not yet invariant: (1) `choose_num_splits` lowers num_splits for wide batches and
caps it (the runner: 32), so contexts longer than num_splits * MIN_SPLIT_KEYS split by the batch's
num_splits; (2) bf16/fp16 dots run on tensor cores with an instruction chosen by BLOCK_M (decode and
prefill configs differ), whose accumulation order is not specified — invariance there needs one
BLOCK_M / num_warps for all regimes; (3) the key tile differs by regime (bf16 decode KV_TILE_DECODE, short chunks
KV_TILE, long chunks PREFILL_KV_TILE; int8 decode KV_TILE_INT8, int8 prefill KV_TILE), which moves tile boundaries and so
the order in which a row's online softmax adds its keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from strata.kernels import device as devices
from strata.kernels import use_pdl, use_triton
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue

LOG2E = 1.4426950408889634
KV_TILE = 64  # keys per tile of bf16/fp16/fp32 caches in short prompt chunks (long: PREFILL_KV_TILE)
KV_TILE_DECODE = 64  # ... in decode-sized steps (DECODE_CONFIG)
KV_TILE_INT8 = 128  # int8 caches in decode-sized steps: the same bytes per tile as 64 bf16 keys
# Key splits of a sequence (not in the invariant mode): at most cdiv(ctx_len, MIN_SPLIT_KEYS), and at most
# max(FEW_SPLITS, cdiv(ctx_len, LONG_SPLIT_KEYS)). The H200's best batch-1 decode splits per context
# (bench/results/attention_decode_splits_cuda.txt): 576 keys -> 5 of 128 (1.09x faster than 3 of 192),
# 1K -> 8 of 128 (1.14x faster than 4 of 256 and than 16 of 64), 2K -> 8 of 256, 4K -> 16 of 256
# (1.21x faster than 32 of 128), longer -> the grid's cap.
MIN_SPLIT_KEYS = 128
FEW_SPLITS = 8
LONG_SPLIT_KEYS = 256


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per program (queries x heads of the group), a power of two >= 16
    num_warps: int
    num_stages: int
    kv_tile: int = KV_TILE  # keys per tile; select_config sets it from KV_TILE / KV_TILE_DECODE / KV_TILE_INT8


# Decode and verify: few query rows, memory bound; small row blocks, splits fill the GPU. Chosen with
# scripts/sweep_attention.py on the H200: 2 warps beat 4 for one sequence at 32K (1555 vs 1254 GB/s of
# K/V) and for int8 at batch 8 (1569 vs 1000), within 2% elsewhere. 128-key tiles with 4 warps and 2
# stages ran the kernel alone 1.03-1.16x faster (`--only decode-short`), but with them the whole Q4_K
# 8B-shape decode fell from 329 to 302 tok/s in two leases (bf16 +0.5%): docs/KERNELS.md.
DECODE_CONFIG = TileConfig(block_m=16, num_warps=2, num_stages=3)
# int8 decode: 128-key tiles converted in registers want 4 warps (sweep_attention.py --only decode-configs
# on the H200: 2,075 GB/s of int8 at 8 sequences x 32K against 1,847 with 2 warps).
DECODE_CONFIG_INT8 = TileConfig(block_m=16, num_warps=4, num_stages=3)
DECODE_MAX_ROWS = 64  # max_q_len * G up to this uses DECODE_CONFIG, rounded up to a power of two
# Prefill (and mixed steps holding a prompt chunk): compute bound. Two warp groups of 128 query rows
# share each 128-key tile, double-buffered (`sweep_attention.py --only prefill` on the H200: 472 TFLOP/s
# on a 32K causal prefill, 467 for an 8K chunk over 32K, against 440 / 413 for one warp group with
# 64-key tiles and 4 stages). int8 caches read directly (prompt-sized int8 steps mostly attend over a
# dequantized bf16 copy) keep 64-key tiles: 245 TFLOP/s against 164 with 128 keys.
PREFILL_KV_TILE = 128
PREFILL_CONFIG = TileConfig(block_m=256, num_warps=8, num_stages=2)
PREFILL_CONFIG_INT8 = TileConfig(block_m=256, num_warps=8, num_stages=2)
# Chunks shorter than PREFILL_WIDE_MIN_Q queries: 64 queries per program would leave SMs idle (a
# 512-token chunk of the 8B shape is 8 x 8 programs), so one warp group of 128 rows over 64-key tiles
# (440 TFLOP/s at 32K in the same sweep). Also fp32 (tests, the fp32 engine) at any length: its FMA
# dots would not fit 256 x 128 score and accumulator tiles in the registers.
PREFILL_CONFIG_NARROW = TileConfig(block_m=128, num_warps=4, num_stages=4)
PREFILL_WIDE_MIN_Q = 1024
# --batch-invariant: one tile shape for every step, so each row's dots run the same MMA
# instruction whether it is decoded, verified or read in a chunk, and key splits of a fixed length at
# absolute positions (see the module docstring's last paragraph).
INVARIANT_CONFIG = TileConfig(block_m=64, num_warps=4, num_stages=2, kv_tile=64)
INVARIANT_SPLIT_KEYS = 256
# Heads of 256: a 128-row query tile (64 KiB of bf16) and two stages of 64-key K and V tiles (128 KiB)
# fit the H200's 227 KiB; the 256 x 128 wide tiles asked for 384 KiB (Qwen3-Next reads, untuned).
PREFILL_CONFIG_WIDE_HEAD = TileConfig(block_m=128, num_warps=8, num_stages=2)
# Heads of 256 in decode-sized steps, four warps over 64-key tiles: the H200 sweep
# (`sweep_attention.py --only decode-wide-head`, bench/results/attn_sweep_wide_head_cuda.txt) had them
# fastest at 5 of 6 (context, batch) points, 12-15% ahead of 32-key tiles at 4K and 32K; in the Qwen3-Next
# profile, decode attention takes 15.7 us a layer, 24 with 32-key tiles.
DECODE_CONFIG_WIDE_HEAD = TileConfig(block_m=16, num_warps=4, num_stages=2, kv_tile=64)
DECODE_CONFIG_WIDE_HEAD_INT8 = TileConfig(block_m=16, num_warps=4, num_stages=2, kv_tile=64)
# Devices whose MMAs take their operands from registers (mma.sync: Ampere, Ada, consumer Blackwell;
# not `DeviceSpec.wgmma`) keep the K and V tiles, the scores and the accumulator in registers, where
# the tiles above spill (compiled for sm_80 / sm_86 / sm_89: the 256-row prompt tile ~2,100 spill
# instructions, 64-key bf16 decode tiles ~50, heads of 256 ~300; sm_80 spills soonest). These compile
# without spills for all three and fit 99 KiB of shared memory (tests/kernels/test_compile_consumer.py);
# untimed. Prompt steps: 8 warps over 128 query rows and 16-key tiles (bf16 / fp16), 64 rows and
# 32-key tiles read straight from int8 in one stage (with two, the LSE output of a streamed host prefix
# spilled on sm_86 / sm_89), 64 rows and 16-key tiles for heads of 256. Decode: 32-key
# bf16 tiles on 4 warps, heads of 256 16-key tiles on 4 warps; int8 decode keeps DECODE_CONFIG_INT8 /
# DECODE_CONFIG_WIDE_HEAD_INT8. Verification steps of 32 and 64 rows take a warp per 8 rows and half
# the keys per doubling of rows, at least 16 (heads of 256 at 64 rows still spill ~40 instructions).
MMA_DECODE_CONFIG = TileConfig(block_m=16, num_warps=4, num_stages=3, kv_tile=32)
MMA_DECODE_CONFIG_WIDE_HEAD = TileConfig(block_m=16, num_warps=4, num_stages=2, kv_tile=16)
MMA_PREFILL_CONFIG = TileConfig(block_m=128, num_warps=8, num_stages=2, kv_tile=16)
MMA_PREFILL_CONFIG_INT8 = TileConfig(block_m=64, num_warps=8, num_stages=1, kv_tile=32)
MMA_PREFILL_CONFIG_WIDE_HEAD = TileConfig(block_m=64, num_warps=8, num_stages=2, kv_tile=16)


def select_config(max_q_len: int, group: int, is_int8: bool = False, fp32: bool = False,
                  head_dim: int = 128, invariant: bool = False, spec: DeviceSpec | None = None) -> TileConfig:
    """Tile shape for a launch (`fp32`: 4-byte queries) on `spec` (default: the current device); reads
    the module constants, so a sweep that changes them clears the cache (`select_config.cache_clear`).
    Heads wider than 128 (Qwen3-Next's 256) halve what shared memory holds per key: two stages,
    prompt-sized steps one warp group over 64-key tiles, and decode-sized steps their own tiles
    (DECODE_CONFIG_WIDE_HEAD). Devices without `wgmma` take the MMA_* tiles (mma.sync), the invariant
    mode excepted."""
    return _select_config(max_q_len, group, is_int8, fp32, head_dim, invariant, spec or devices.current())


@lru_cache(maxsize=256)
def _select_config(max_q_len: int, group: int, is_int8: bool, fp32: bool, head_dim: int, invariant: bool,
                   spec: DeviceSpec) -> TileConfig:
    if invariant:
        cfg = INVARIANT_CONFIG
        return TileConfig(max(cfg.block_m, triton.next_power_of_2(group)), cfg.num_warps, cfg.num_stages, cfg.kv_tile)
    rows = max_q_len * group
    if not spec.wgmma:
        return _mma_config(rows, group, is_int8, head_dim)
    if rows <= DECODE_MAX_ROWS:
        cfg = DECODE_CONFIG_INT8 if is_int8 else DECODE_CONFIG
        block_m = max(cfg.block_m, triton.next_power_of_2(rows))
        kv_tile = KV_TILE_INT8 if is_int8 else KV_TILE_DECODE
        if head_dim > 128:
            cfg = DECODE_CONFIG_WIDE_HEAD_INT8 if is_int8 else DECODE_CONFIG_WIDE_HEAD
            return TileConfig(block_m, cfg.num_warps, cfg.num_stages, cfg.kv_tile)
    else:
        wide = max_q_len >= PREFILL_WIDE_MIN_Q and not fp32
        cfg = (PREFILL_CONFIG_INT8 if is_int8 else PREFILL_CONFIG) if wide else PREFILL_CONFIG_NARROW
        if head_dim > 128:
            cfg = PREFILL_CONFIG_WIDE_HEAD
        block_m = max(cfg.block_m, triton.next_power_of_2(group))
        kv_tile = PREFILL_KV_TILE if wide and not is_int8 and head_dim <= 128 else KV_TILE
    stages = min(cfg.num_stages, 2) if head_dim > 128 else cfg.num_stages
    return TileConfig(block_m, cfg.num_warps, stages, kv_tile)


select_config.cache_clear = _select_config.cache_clear


def _mma_config(rows: int, group: int, is_int8: bool, head_dim: int) -> TileConfig:
    """The tiles of a device whose MMAs read registers (`_select_config`'s MMA_* branch)."""
    if rows <= DECODE_MAX_ROWS:
        if head_dim > 128:
            cfg = DECODE_CONFIG_WIDE_HEAD_INT8 if is_int8 else MMA_DECODE_CONFIG_WIDE_HEAD
        else:
            cfg = DECODE_CONFIG_INT8 if is_int8 else MMA_DECODE_CONFIG
        kv_tile = KV_TILE_INT8 if is_int8 and head_dim <= 128 else cfg.kv_tile
        block_m = max(cfg.block_m, triton.next_power_of_2(rows))
        growth = block_m // cfg.block_m
        return TileConfig(block_m, max(cfg.num_warps, block_m // 8), cfg.num_stages, max(16, kv_tile // growth))
    cfg = (MMA_PREFILL_CONFIG_WIDE_HEAD if head_dim > 128 else MMA_PREFILL_CONFIG_INT8 if is_int8
           else MMA_PREFILL_CONFIG)
    return TileConfig(max(cfg.block_m, triton.next_power_of_2(group)), cfg.num_warps, cfg.num_stages, cfg.kv_tile)


class SplitWorkspace:
    """Partial results of split-KV attention, allocated once and reused by every call.

    acc (max_rows, Hq, max_splits, D) holds unnormalised outputs; m and l (max_rows, Hq, max_splits)
    the running max (log2 domain) and softmax sum. Row index = the query row in q. counters
    (max_rows, Hq) int32 count the finished splits of a query tile, at [first row of the tile, kv head];
    they are zero between calls (the merging program resets its own) and must start at zero."""

    def __init__(self, max_rows: int, num_q_heads: int, head_dim: int, max_splits: int, device):
        self.max_rows, self.num_q_heads, self.head_dim, self.max_splits = max_rows, num_q_heads, head_dim, max_splits
        self.acc = torch.empty((max_rows, num_q_heads, max_splits, head_dim), dtype=torch.float32, device=device)
        self.m = torch.empty((max_rows, num_q_heads, max_splits), dtype=torch.float32, device=device)
        self.l = torch.empty_like(self.m)
        self.counters = torch.zeros((max_rows, num_q_heads), dtype=torch.int32, device=device)


SPLIT_WAVES = 2  # programs per SM that key splits aim for


def choose_num_splits(num_seqs: int, max_q_len: int, num_kv_heads: int, max_ctx: int, num_sms: int,
                      max_splits: int, waves: int | None = None) -> int:
    """Splits per sequence so that small, long-context batches still fill about `waves` (default
    SPLIT_WAVES) programs per SM.

    An upper bound: the kernel gives each sequence at most `active_splits(ctx_len, num_splits)`, so
    max_ctx may be the longest context a captured graph will ever see. Query tiles are estimated at 16
    queries (the kernel's tile depends on the group size, which this host-side heuristic does not need
    to know exactly)."""
    programs = max(1, num_seqs * num_kv_heads * triton.cdiv(max(max_q_len, 1), 16))
    target = (waves or SPLIT_WAVES) * num_sms
    if programs >= target:
        return 1
    splits = triton.cdiv(target, programs)
    return max(1, active_splits(max(max_ctx, 1), min(splits, max_splits)))


def active_splits(ctx_len: int, num_splits: int) -> int:
    """The splits the kernel gives a context of ctx_len keys under a grid of num_splits (its rule, on
    the host; non-decreasing in ctx_len, so the bound for the longest context bounds every shorter one)."""
    return min(num_splits, triton.cdiv(ctx_len, MIN_SPLIT_KEYS), max(FEW_SPLITS, triton.cdiv(ctx_len, LONG_SPLIT_KEYS)))


def attention_flops(q_len: int, ctx_len: int, num_q_heads: int, head_dim: int) -> float:
    """QK^T and PV matmul flops of one sequence's causal attention: 4 * D * Hq per (query, key) pair."""
    pairs = q_len * (ctx_len - q_len) + q_len * (q_len + 1) // 2
    return 4.0 * head_dim * num_q_heads * pairs


@triton.jit
def _load_int8_tile_by_words(base, slots, stride_slot, in_range, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                             MASKED: tl.constexpr):
    """An int8 [BLOCK_N, HEAD_DIM] tile read as int32 words and unpacked in registers. PV needs V
    transposed; a tile loaded as int8 feeds that operand from shared memory one byte per load (sm_90 has
    no 8-bit ldmatrix.trans), while a tile built in registers is staged as bf16 and read with
    ldmatrix.trans like a bf16 tile. Bytes are little-endian: element 4 w + i is byte i of word w."""
    offs_w = tl.arange(0, HEAD_DIM // 4)
    w_ptrs = base.to(tl.pointer_type(tl.int32)) + slots[:, None] * (stride_slot // 4) + offs_w[None, :]
    if MASKED:
        w = tl.load(w_ptrs, mask=in_range[:, None], other=0)
    else:
        w = tl.load(w_ptrs)
    b0 = w.to(tl.int8)
    b1 = (w >> 8).to(tl.int8)
    b2 = (w >> 16).to(tl.int8)
    b3 = (w >> 24).to(tl.int8)
    # join(join(b0, b2), join(b1, b3))[.., i, j] = b_{2i + j}: row-major flattening restores the order.
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BLOCK_N, HEAD_DIM])


@triton.jit
def _attend_kv_tile(acc, l_i, m_i, q, pos, start, kv_hi, table_row, k_base, v_base, ks_base, vs_base,
                    stride_k_slot, stride_v_slot, stride_ks_slot, stride_vs_slot, qk_scale,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    MASKED: tl.constexpr, IS_INT8: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_n < kv_hi
    if MASKED:
        block_ids = tl.load(table_row + offs_n // BLOCK_SIZE, mask=in_range, other=0)
    else:
        block_ids = tl.load(table_row + offs_n // BLOCK_SIZE)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    k_ptrs = k_base + slots[:, None] * stride_k_slot + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_range[:, None], other=0)
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
    if IS_INT8:
        if MASKED:
            k_scale = tl.load(ks_base + slots * stride_ks_slot, mask=in_range, other=0.0)
        else:
            k_scale = tl.load(ks_base + slots * stride_ks_slot)
        s = s * (k_scale * qk_scale)[None, :]
        col_scale = 1.0
    else:
        # The scale stays out of s: the row max of raw scores times the (positive) scale is the max of
        # the scaled ones, and p takes scale and shift in one FMA per score.
        col_scale = qk_scale
    if MASKED:
        visible = in_range[None, :] & (offs_n[None, :] <= pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * col_scale)
    # A row with no visible key yet keeps m = -inf; shifting by 0 then keeps p = 0 and avoids inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s * col_scale - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IS_INT8:
        v = _load_int8_tile_by_words(v_base, slots, stride_v_slot, in_range, BLOCK_N, HEAD_DIM, MASKED)
        if MASKED:
            v_scale = tl.load(vs_base + slots * stride_vs_slot, mask=in_range, other=0.0)
        else:
            v_scale = tl.load(vs_base + slots * stride_vs_slot)
        p = p * v_scale[None, :]
    else:
        v_ptrs = v_base + slots[:, None] * stride_v_slot + offs_d[None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0)
        else:
            v = tl.load(v_ptrs)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attend_kv_range(acc, l_i, m_i, q, pos, kv_lo, full_stop, kv_stop, kv_hi, table_row, k_base, v_base,
                     ks_base, vs_base, stride_k_slot, stride_v_slot, stride_ks_slot, stride_vs_slot, qk_scale,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     IS_INT8: tl.constexpr, DOT_PREC: tl.constexpr):
    """Key tiles from kv_lo: unmasked below full_stop (visible to every row), masked up to kv_stop."""
    for start in range(kv_lo, full_stop, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(acc, l_i, m_i, q, pos, start, kv_hi, table_row, k_base, v_base,
                                        ks_base, vs_base, stride_k_slot, stride_v_slot, stride_ks_slot,
                                        stride_vs_slot, qk_scale, BLOCK_N, HEAD_DIM, BLOCK_SIZE,
                                        False, IS_INT8, DOT_PREC)
    for start in range(full_stop, kv_stop, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(acc, l_i, m_i, q, pos, start, kv_hi, table_row, k_base, v_base,
                                        ks_base, vs_base, stride_k_slot, stride_v_slot, stride_ks_slot,
                                        stride_vs_slot, qk_scale, BLOCK_N, HEAD_DIM, BLOCK_SIZE,
                                        True, IS_INT8, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _store_output(out_ptr, rows, head, row_ok, acc, l_i, stride_on, stride_oh, HEAD_DIM: tl.constexpr,
                  lse_ptr, m_i, stride_ln, stride_lh, WRITE_LSE: tl.constexpr):
    """`WRITE_LSE`: also the row's natural log-sum-exp of its scaled scores, from the log2-domain running
    max m_i and sum l_i: l is at least 1 where m is finite, and m is -inf where l is 0 (no key seen)."""
    offs_d = tl.arange(0, HEAD_DIM)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only rows outside the sequence, which are not stored
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # ln 2: log2 domain to natural log
        tl.store(lse_ptr + rows * stride_ln + head * stride_lh, lse, mask=row_ok)


@triton.jit
def _merge_running(acc, l_i, m_i, p_acc, p_l, p_m):
    """The invariant mode's merge of one more split's partial into the running result. The same code
    merges in registers (a program that walks its splits itself) and from the workspace, and the FMAs
    are explicit, so both give the same bits. An empty partial (m = -inf, l = 0) changes nothing."""
    m_new = tl.maximum(m_i, p_m)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(m_i - m_shift)
    b = tl.math.exp2(p_m - m_shift)
    acc = tl.fma(acc, a[:, None], p_acc * b[:, None])
    l_i = tl.fma(l_i, a, p_l * b)
    return acc, l_i, m_new


@triton.jit
def _merge_partials(ws_acc_ptr, ws_m_ptr, ws_l_ptr, rows, head, row_ok, num_parts,
                    stride_wa_n, stride_wa_h, stride_wa_s, stride_wm_n, stride_wm_h,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, INVARIANT: tl.constexpr):
    """Combines the partial results of splits 0 .. num_parts - 1, in that order. Split 0 holds key 0,
    so every real row has a finite max; a row's split with no visible key adds exp2(-inf) * 0. Returns
    (acc, l, m) of the whole row, m the log2-domain max its l is relative to."""
    offs_d = tl.arange(0, HEAD_DIM)
    ml = ws_m_ptr + rows * stride_wm_n + head * stride_wm_h
    ll = ws_l_ptr + rows * stride_wm_n + head * stride_wm_h
    wa = ws_acc_ptr + rows[:, None] * stride_wa_n + head[:, None] * stride_wa_h + offs_d[None, :]
    # .cg: written by other SMs during this launch, so read through L2.
    if INVARIANT:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in range(0, num_parts):
            p_m = tl.load(ml + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
            p_l = tl.load(ll + s, mask=row_ok, other=0.0, cache_modifier=".cg")
            p_acc = tl.load(wa + s * stride_wa_s, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            acc, l_run, m_run = _merge_running(acc, l_run, m_run, p_acc, p_l, p_m)
        return acc, l_run, m_run
    m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(0, num_parts):
        m_max = tl.maximum(m_max, tl.load(ml + s, mask=row_ok, other=0.0, cache_modifier=".cg"))
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(0, num_parts):
        w = tl.math.exp2(tl.load(ml + s, mask=row_ok, other=0.0, cache_modifier=".cg") - m_max)
        part = tl.load(wa + s * stride_wa_s, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        acc += w[:, None] * part
        l_sum += w * tl.load(ll + s, mask=row_ok, other=0.0, cache_modifier=".cg")
    return acc, l_sum, m_max


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, table_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr,
    ws_acc_ptr, ws_m_ptr, ws_l_ptr, ws_count_ptr, lse_ptr,
    stride_qn, stride_qh, stride_k_slot, stride_kh, stride_v_slot, stride_vh,
    stride_ks_slot, stride_ksh, stride_vs_slot, stride_vsh, stride_on, stride_oh, stride_table,
    stride_wa_n, stride_wa_h, stride_wa_s, stride_wm_n, stride_wm_h, stride_wc_n, stride_ln, stride_lh,
    qk_scale, num_q_tiles, num_splits, min_split_keys,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_INT8: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr, INVARIANT: tl.constexpr, USE_PDL: tl.constexpr,
    FEW_SPLITS: tl.constexpr, LONG_SPLIT_KEYS: tl.constexpr, WRITE_LSE: tl.constexpr,
    WHOLE_CONTEXT: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = pid // num_q_tiles
    q_tile = num_q_tiles - 1 - pid % num_q_tiles  # later (costlier) causal tiles launch first
    q_len = tl.load(q_len_ptr + seq)
    tile_q0 = q_tile * BLOCK_Q
    if tile_q0 >= q_len:
        return
    ctx = tl.load(ctx_len_ptr + seq)
    row0 = tl.load(q_start_ptr + seq)
    if WHOLE_CONTEXT:  # every row sits after the whole context (keys that precede the step's rows)
        first_pos = ctx - 1
        last_pos = ctx - 1
    else:
        first_pos = ctx - q_len + tile_q0
        last_pos = ctx - q_len + tl.minimum(tile_q0 + BLOCK_Q, q_len) - 1
    if SPLIT:
        split = tl.program_id(2)
        if INVARIANT:  # fixed-length splits at absolute positions; the grid has enough of them
            split_len = min_split_keys
        else:
            active = tl.minimum(tl.minimum(num_splits, tl.cdiv(ctx, min_split_keys)),
                                tl.maximum(FEW_SPLITS, tl.cdiv(ctx, LONG_SPLIT_KEYS)))
            split_len = tl.cdiv(tl.cdiv(ctx, active), BLOCK_N) * BLOCK_N
        # The splits that start at or before the tile's last position: at most `active`, fewer when
        # rounding split_len up to whole tiles empties the last ones or the tile ends early (causal).
        num_parts = last_pos // split_len + 1
        if split >= num_parts:
            return
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_lo + split_len, ctx)
    else:
        kv_lo = 0
        kv_hi = ctx
    kv_stop = tl.minimum(kv_hi, last_pos + 1)
    # Tiles below full_stop are visible to every row of the query tile: no mask needed.
    full_stop = kv_lo + tl.maximum(tl.minimum(kv_stop, first_pos + 1) - kv_lo, 0) // BLOCK_N * BLOCK_N

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = tile_q0 + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    if WHOLE_CONTEXT:
        pos = tl.full([BLOCK_M], 0, tl.int32) + (ctx - 1)
    else:
        pos = ctx - q_len + q_idx
    rows = (row0 + q_idx).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    table_row = table_ptr + seq.to(tl.int64) * stride_table
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    ks_base = ks_ptr + kv_head * stride_ksh
    vs_base = vs_ptr + kv_head * stride_vsh
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if INVARIANT and not SPLIT:
        # One program walks all of its splits and merges them as the workspace merge would.
        for part in range(0, last_pos // min_split_keys + 1):
            p_lo = part * min_split_keys
            p_hi = tl.minimum(p_lo + min_split_keys, ctx)
            p_stop = tl.minimum(p_hi, last_pos + 1)
            p_full = p_lo + tl.maximum(tl.minimum(p_stop, first_pos + 1) - p_lo, 0) // BLOCK_N * BLOCK_N
            p_acc, p_l, p_m = _attend_kv_range(
                tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
                tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), q, pos, p_lo, p_full, p_stop, p_hi,
                table_row, k_base, v_base, ks_base, vs_base, stride_k_slot, stride_v_slot, stride_ks_slot,
                stride_vs_slot, qk_scale, BLOCK_N, HEAD_DIM, BLOCK_SIZE, IS_INT8, DOT_PREC)
            acc, l_i, m_i = _merge_running(acc, l_i, m_i, p_acc, p_l, p_m)
    else:
        acc, l_i, m_i = _attend_kv_range(acc, l_i, m_i, q, pos, kv_lo, full_stop, kv_stop, kv_hi, table_row,
                                         k_base, v_base, ks_base, vs_base, stride_k_slot, stride_v_slot,
                                         stride_ks_slot, stride_vs_slot, qk_scale, BLOCK_N, HEAD_DIM, BLOCK_SIZE,
                                         IS_INT8, DOT_PREC)

    if SPLIT:
        if num_parts == 1:
            _store_output(out_ptr, rows, head, row_ok, acc, l_i, stride_on, stride_oh, HEAD_DIM,
                          lse_ptr, m_i, stride_ln, stride_lh, WRITE_LSE)
        else:
            wa = ws_acc_ptr + rows[:, None] * stride_wa_n + head[:, None] * stride_wa_h + split * stride_wa_s
            tl.store(wa + offs_d[None, :], acc, mask=row_ok[:, None])
            wm = rows * stride_wm_n + head * stride_wm_h + split
            tl.store(ws_m_ptr + wm, m_i, mask=row_ok)
            tl.store(ws_l_ptr + wm, l_i, mask=row_ok)
            # Every thread's stores precede the barrier, and the barrier the release: the ticket
            # publishes the whole partial, not only the part the atomic's own thread wrote.
            tl.debug_barrier()
            counter = ws_count_ptr + (row0 + tile_q0).to(tl.int64) * stride_wc_n + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == num_parts - 1:
                tl.debug_barrier()  # the acquire (one thread) before any thread's loads of the partials
                acc, l_i, m_i = _merge_partials(ws_acc_ptr, ws_m_ptr, ws_l_ptr, rows, head, row_ok, num_parts,
                                                stride_wa_n, stride_wa_h, stride_wa_s, stride_wm_n, stride_wm_h,
                                                BLOCK_M, HEAD_DIM, INVARIANT)
                _store_output(out_ptr, rows, head, row_ok, acc, l_i, stride_on, stride_oh, HEAD_DIM,
                              lse_ptr, m_i, stride_ln, stride_lh, WRITE_LSE)
                tl.store(counter, 0)  # every other split has arrived: nothing else touches it this launch
    else:
        _store_output(out_ptr, rows, head, row_ok, acc, l_i, stride_on, stride_oh, HEAD_DIM,
                      lse_ptr, m_i, stride_ln, stride_lh, WRITE_LSE)


def _check_inputs(q, k_cache, v_cache, block_tables, q_start, q_len, ctx_len, out, k_scale, v_scale):
    """Shape, dtype and device checks that never touch device memory."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [N, Hq, D] and k/v caches [slots, Hkv, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[2] != d or hq % hkv != 0:
        raise ValueError(f"q heads {hq} / dim {d} do not fit kv heads {hkv} / dim {k_cache.shape[2]}")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)}")
    for name, t in (("block_tables", block_tables), ("q_start", q_start), ("q_len", q_len), ("ctx_len", ctx_len)):
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"{name} must be int32 on {q.device}, got {t.dtype} on {t.device}")
    r = q_len.shape[0]
    if q_start.shape != (r,) or ctx_len.shape != (r,) or block_tables.dim() != 2 or block_tables.shape[0] != r:
        raise ValueError("q_start, q_len, ctx_len must be [R] and block_tables [R, B]")
    is_int8 = k_cache.dtype == torch.int8
    if is_int8 != (v_cache.dtype == torch.int8) or is_int8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("int8 caches need k_scale and v_scale; other caches take none")
    if is_int8 and (k_scale.shape != k_cache.shape[:2] or v_scale.shape != v_cache.shape[:2]):
        raise ValueError(f"k_scale / v_scale must be [slots, Hkv] = {tuple(k_cache.shape[:2])}")
    return n, hq, d, hkv, r, is_int8


def paged_attention_triton(q, k_cache, v_cache, block_tables, q_start, q_len, ctx_len, out, *, block_size: int,
                           max_q_len: int, scale: float, k_scale=None, v_scale=None, num_splits: int = 1,
                           workspace: SplitWorkspace | None = None, invariant: bool = False,
                           lse: torch.Tensor | None = None, whole_context: bool = False) -> torch.Tensor:
    """`invariant` (--batch-invariant): INVARIANT_CONFIG and splits of INVARIANT_SPLIT_KEYS keys. With
    num_splits > 1 the splits run as programs of their own (the grid needs num_splits >= cdiv(longest
    context, INVARIANT_SPLIT_KEYS)); with num_splits == 1 each program walks its splits itself. Both
    give a row the same bits. `lse` [N, Hq] fp32: also each sequence row's log-sum-exp of its scaled
    scores (natural log, after the split merge), for merging with attention over other keys; without
    it the launch compiles no LSE store and `out` is unchanged. `whole_context`: every row of a
    sequence sees all ctx_len keys, which precede its rows (a host prefix streamed to the device, whose
    rows' own keys are attended elsewhere); q_len may then exceed ctx_len."""
    n, hq, d, hkv, r, is_int8 = _check_inputs(q, k_cache, v_cache, block_tables, q_start, q_len, ctx_len, out,
                                              k_scale, v_scale)
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if is_int8 and (k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32):
        raise ValueError("k_scale / v_scale must be float32")
    if is_int8 and (v_cache.data_ptr() % 4 or v_cache.stride(0) % 4 or v_cache.stride(1) % 4):
        raise ValueError("an int8 v_cache must be 4-byte aligned in its pointer and strides (read as int32 words)")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if lse is not None and (lse.shape != (n, hq) or lse.dtype != torch.float32 or lse.device != q.device):
        raise ValueError(f"lse must be float32 [{n}, {hq}] on {q.device}, got {lse.dtype} {tuple(lse.shape)} "
                         f"on {lse.device}")
    split = num_splits > 1
    if split:
        if workspace is None:
            raise ValueError("num_splits > 1 needs a SplitWorkspace (preallocated, reused every call)")
        if (workspace.max_rows < n or workspace.num_q_heads != hq or workspace.head_dim != d
                or workspace.max_splits < num_splits or workspace.acc.device != q.device):
            raise ValueError(f"workspace ({workspace.max_rows} rows, {workspace.num_q_heads} heads, dim "
                             f"{workspace.head_dim}, {workspace.max_splits} splits) too small for {n} rows, "
                             f"{hq} heads, dim {d}, {num_splits} splits")
    if r == 0 or n == 0 or max_q_len <= 0:
        return out
    group = hq // hkv
    cfg = select_config(max_q_len, group, is_int8, q.dtype == torch.float32, d, invariant, devices.current(q))
    block_q = cfg.block_m // group
    num_q_tiles = triton.cdiv(max_q_len, block_q)
    ks, vs = (k_scale, v_scale) if is_int8 else (k_cache, v_cache)  # placeholders, never read
    if split:
        ws = (workspace.acc, workspace.m, workspace.l, workspace.counters)
        ws_strides = (*workspace.acc.stride()[:3], *workspace.m.stride()[:2], workspace.counters.stride(0))
    else:
        ws, ws_strides = (out, out, out, q_len), (0,) * 6  # placeholders, never read
    ks_strides = ks.stride()[:2] if is_int8 else (0, 0)
    vs_strides = vs.stride()[:2] if is_int8 else (0, 0)
    lse_strides = lse.stride() if lse is not None else (0, 0)
    on = use_pdl(q)
    grid = (r * num_q_tiles, hkv, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, ks, vs, out, block_tables, q_start, q_len, ctx_len, *ws,
        lse if lse is not None else out,  # a placeholder, never written without WRITE_LSE
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *ks_strides, *vs_strides, out.stride(0), out.stride(1), block_tables.stride(0), *ws_strides, *lse_strides,
        scale * LOG2E, num_q_tiles, num_splits, INVARIANT_SPLIT_KEYS if invariant else MIN_SPLIT_KEYS,
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.kv_tile, HEAD_DIM=d, BLOCK_SIZE=block_size,
        IS_INT8=is_int8, SPLIT=split, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        INVARIANT=invariant, USE_PDL=on, FEW_SPLITS=FEW_SPLITS, LONG_SPLIT_KEYS=LONG_SPLIT_KEYS,
        WRITE_LSE=lse is not None, WHOLE_CONTEXT=whole_context, launch_pdl=on, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Pool semantics: int8 * scale in fp32, then the compute dtype (as KVPool.gather returns it)."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale[..., None]).to(dtype)


def paged_attention_ref(q, k_cache, v_cache, block_tables, q_start, q_len, ctx_len, out, *, block_size: int,
                        max_q_len: int, scale: float, k_scale=None, v_scale=None, num_splits: int = 1,
                        workspace: SplitWorkspace | None = None, lse: torch.Tensor | None = None,
                        whole_context: bool = False) -> torch.Tensor:
    """The definition: a loop over sequences, fp32 math, cast to out's dtype (`lse` [N, Hq]: each row's
    log-sum-exp of its scaled scores; `whole_context`: every row sees all ctx_len keys). num_splits and
    workspace are accepted for a common signature and ignored (splitting changes rounding only)."""
    _, hq, _, hkv, _, _ = _check_inputs(q, k_cache, v_cache, block_tables, q_start, q_len, ctx_len, out,
                                        k_scale, v_scale)
    group = hq // hkv
    for r, (row0, n, ctx) in enumerate(zip(q_start.tolist(), q_len.tolist(), ctx_len.tolist())):
        if n == 0:
            continue
        if n > max_q_len or (n > ctx and not whole_context):
            raise ValueError(f"sequence {r}: q_len {n} exceeds max_q_len {max_q_len} or ctx_len {ctx}")
        t = torch.arange(ctx, device=q.device)
        slots = block_tables[r].long()[t // block_size] * block_size + t % block_size
        k = _dequantize(k_cache[slots], None if k_scale is None else k_scale[slots], q.dtype).float()
        v = _dequantize(v_cache[slots], None if v_scale is None else v_scale[slots], q.dtype).float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        qq = q[row0:row0 + n].float()
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        q_pos = torch.full((n,), ctx - 1, device=q.device) if whole_context else ctx - n + torch.arange(n, device=q.device)
        scores.masked_fill_(t[None, None, :] > q_pos[None, :, None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        out[row0:row0 + n] = o.to(out.dtype)
        if lse is not None:
            lse[row0:row0 + n] = torch.logsumexp(scores, dim=-1).T
    return out


def paged_attention(q, k_cache, v_cache, block_tables, q_start, q_len, ctx_len, out, *, block_size: int,
                    max_q_len: int, scale: float, k_scale=None, v_scale=None, num_splits: int = 1,
                    workspace: SplitWorkspace | None = None) -> torch.Tensor:
    """Attention of the step's query rows over the paged pool, written into `out` (returned)."""
    fn = paged_attention_triton if use_triton(q) else paged_attention_ref
    return fn(q, k_cache, v_cache, block_tables, q_start, q_len, ctx_len, out, block_size=block_size,
              max_q_len=max_q_len, scale=scale, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits,
              workspace=workspace)
