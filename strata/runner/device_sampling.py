"""Batched sampling on the logits' device, with counter-based randomness instead of generators.

Per row, the transforms of `sampling.py` in its order: logit bias → repetition penalty → temperature →
top-k → top-p → min-p → draw. Greedy rows (temperature 0) take the argmax of the biased, penalised
logits.

The draw is a Gumbel-max race: token = argmax over kept v of `z_v + G(v)`, z the filtered logits and
G(v) = -log(-log(u_v)) with u_v a uniform that is a pure function of (seed, counter, stream, v), so
a request needs no generator state: `counter` (its draws so far) selects fresh noise each draw, and
the same (seed, counter) gives the same token. Ties go to the smallest vocabulary id, so the result
never depends on the order in which a kernel visits the vocabulary (sorted or not).

The hash, all arithmetic on unsigned 32-bit words (identical on the host, in torch int64 tensors and
in Triton uint32, so the noise bits are the same everywhere; only the float `log` may differ by one
ulp between devices):

    mix32(x):  x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15  (mod 2^32)
    row keys (host, per row, seed and counter taken mod 2^64):
        h = mix32(seed_lo ^ 0x9E3779B9); h = mix32(h ^ seed_hi)
        h = mix32(h ^ counter_lo); h = mix32(h ^ counter_hi); h = mix32(h ^ stream)
        k1 = h; k2 = mix32(h ^ 0x85EBCA6B)
    noise bits (device, per row and vocabulary id v): b = mix32(mix32(v ^ k1) ^ k2)
    uniform: u = (2 * (b >> 9) + 1) / 2^24, 23 bits, in [2^-24, 1 - 2^-24] (exact in fp32)

Both multipliers are below 2^31, so the torch version multiplies 32-bit values in int64 without
overflow. Index v = 0xFFFFFFFF (never a vocabulary id) gives the acceptance uniform of speculative
verification. Streams keep independent draws apart: STREAM_SAMPLE for the target's tokens,
STREAM_DRAFT for a drafter sampling at the same counters.

Rows are processed in blocks of `chunk_rows` to bound the vocabulary-sized temporaries (a sort of
[rows, V] and its int64 order dominate). Everything in `DeviceSampler.run` is free of host reads and
data-dependent shapes, so it can be captured in a CUDA graph; `fill` is the host half.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from strata.kernels import use_triton
from strata.kernels.row_lse import row_logsumexp
from strata.params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_TOP_K, REPETITION_PENALTY_RANGE, SamplingParams
from strata.kernels.transfer import to_device

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    jit = triton.jit
except ImportError:  # CPU-only installs: the torch reference runs instead

    def jit(fn):
        return fn


MASK32 = 0xFFFFFFFF
MIX_MUL1, MIX_MUL2 = 0x21F0AAAD, 0x735A2D97
SEED_SALT, KEY2_SALT = 0x9E3779B9, 0x85EBCA6B
ACCEPT_INDEX = MASK32
STREAM_SAMPLE, STREAM_DRAFT = 0, 1
RACE_BLOCK = 4096
_NO_ID = 1 << 62  # larger than any vocabulary id, for "smallest id among the maxima"

# Per-row parameter columns. Floats: temperature (1 for greedy), top-p (2.0 = off), log(min-p) (-inf
# = off), repetition penalty (1 = off), noise scale (0 greedy, 1 sampled). Ints: key 1, key 2, index
# of the top-k-th sorted value (V-1 = off).
_TEMP, _TOP_P, _LOG_MIN_P, _PENALTY, _NOISE = range(5)
_KEY1, _KEY2, _KTH = range(3)
_N_FLOAT, _N_INT = 5, 3


@dataclass
class RowParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    counter: int = 0
    seen: Sequence[int] | None = None  # token ids the repetition penalty applies to (duplicates fine)
    stream: int = STREAM_SAMPLE
    bias: Sequence[tuple[int, float]] | None = None  # (token id, value added to its logit)
    # OpenAI's presence and frequency penalties, as values added with the bias: (token id,
    # -(presence + frequency x its count in the output)), from `output_penalties`.
    penalties: Sequence[tuple[int, float]] | None = None

    @property
    def added(self) -> list[tuple[int, float]]:
        """Everything added to the logits before the repetition penalty: logit bias, then penalties."""
        return [*(self.bias or ()), *(self.penalties or ())]

    @classmethod
    def of(cls, p: SamplingParams, seed: int, counter: int, seen: Sequence[int] | None = None,
           stream: int = STREAM_SAMPLE) -> RowParams:
        return cls(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, seed, counter,
                   seen if p.repetition_penalty != 1.0 else None, stream, tuple(p.logit_bias.items()) or None)

    def check(self, vocab: int) -> None:
        """Raises ValueError unless every value fits the sampler's columns: the runner checks each
        request's rows apart, so one bad row fails its own request, not the batch it is packed into.
        (Chained comparisons: NaN fails each of them, infinity the bounded ones.)"""
        lo, hi = REPETITION_PENALTY_RANGE
        if not (0 <= self.temperature < math.inf and 0 < self.top_p <= 1 and 0 <= self.min_p <= 1
                and lo <= self.repetition_penalty <= hi):
            raise ValueError(f"sampling parameters out of range: temperature {self.temperature}, top_p {self.top_p}, "
                             f"min_p {self.min_p}, repetition_penalty {self.repetition_penalty}")
        if not (type(self.top_k) is int and 0 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k!r}")
        if not (type(self.seed) is int and type(self.counter) is int and self.counter >= 0):
            raise ValueError("seed and counter must be integers")
        if self.bias:
            if len(self.bias) > MAX_LOGIT_BIAS_TOKENS:
                raise ValueError(f"logit bias for {len(self.bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS}")
            for t, b in self.bias:
                if not (type(t) is int and 0 <= t < vocab and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit bias ({t!r}, {b!r}): ids in [0, {vocab}), values in "
                                     f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for t, b in self.penalties or ():
            if not (type(t) is int and 0 <= t < vocab and math.isfinite(b)):
                raise ValueError(f"penalty ({t!r}, {b!r}): ids in [0, {vocab}), finite values")


@dataclass(frozen=True)
class SamplePlan:
    """What `run` does for a filled batch; decided on the host from the parameters, never from device
    values. A static plan (every stage, full seen width) is what a CUDA graph captures."""

    rows: int
    width: int  # seen-list columns (0: no penalty stage)
    sort: bool  # a top-k or top-p row: sort each row once, both read the sorted values
    sample: bool  # any row not greedy (else argmax only)
    top_k: int = 0  # every row has top-k on: the largest k (the CPU sorts only that many candidates), else 0
    bias: int = 0  # logit-bias columns (0: no bias stage)


# ---- the hash ---------------------------------------------------------------------------------------
def mix32(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_MUL1) & MASK32
    x ^= x >> 15
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 15)


def row_keys(seed: int, counter: int, stream: int = STREAM_SAMPLE) -> tuple[int, int]:
    """The two 32-bit keys of one draw (the scalar definition; `_row_keys_np` is its vector form)."""
    seed &= (1 << 64) - 1
    counter &= (1 << 64) - 1
    h = mix32((seed & MASK32) ^ SEED_SALT)
    for word in (seed >> 32, counter & MASK32, counter >> 32, stream & MASK32):
        h = mix32(h ^ word)
    return h, mix32(h ^ KEY2_SALT)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(MIX_MUL1)  # uint32 arrays wrap mod 2^32
    x ^= x >> np.uint32(15)
    x = x * np.uint32(MIX_MUL2)
    return x ^ (x >> np.uint32(15))


def _row_keys_np(seeds, counters, streams) -> tuple[np.ndarray, np.ndarray]:
    seeds, counters, streams = list(seeds), list(counters), list(streams)
    if len(seeds) <= 4:  # a decode step's few rows: the scalar form, without numpy's per-call cost
        keys = [row_keys(*key) for key in zip(seeds, counters, streams)]
        return np.array([k[0] for k in keys], dtype=np.uint32), np.array([k[1] for k in keys], dtype=np.uint32)
    full = (1 << 64) - 1
    s = np.array([v & full for v in seeds], dtype=np.uint64)
    c = np.array([v & full for v in counters], dtype=np.uint64)
    m32 = np.uint64(MASK32)
    h = _mix32_np((s & m32).astype(np.uint32) ^ np.uint32(SEED_SALT))
    for word in ((s >> np.uint64(32)).astype(np.uint32), (c & m32).astype(np.uint32),
                 (c >> np.uint64(32)).astype(np.uint32), np.asarray(streams, dtype=np.uint64).astype(np.uint32)):
        h = _mix32_np(h ^ word)
    return h, _mix32_np(h ^ np.uint32(KEY2_SALT))


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    """mix32 on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL1) & MASK32
    x ^= x >> 15
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 15)


def noise_bits(k1: torch.Tensor, k2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """b = mix32(mix32(v ^ k1) ^ k2): k1, k2 [M] int64; ids [M, V] or [V] int64 → [M, V] int64."""
    return _mix32_t(_mix32_t(ids ^ k1[:, None]) ^ k2[:, None])


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return ((bits >> 9) * 2 + 1).to(torch.float32) * 2.0**-24


def _uniform_np(k1: np.ndarray, k2: np.ndarray, index: int) -> np.ndarray:
    b = _mix32_np(_mix32_np(np.uint32(index) ^ k1) ^ k2)
    return ((b >> np.uint32(9)).astype(np.float32) * 2 + 1) * np.float32(2.0**-24)


# ---- the race ---------------------------------------------------------------------------------------
def race_ref(score: torch.Tensor, ids: torch.Tensor | None, k1: torch.Tensor, k2: torch.Tensor,
             noise: torch.Tensor) -> torch.Tensor:
    """argmax over columns of score + noise * G(ids), ties to the smallest id. score [M, N] fp32 log-weights
    (-inf: excluded); ids [M, N] int64 vocabulary ids of the columns (None: the column index)."""
    if ids is None:
        ids = torch.arange(score.shape[1], device=score.device)
    u = uniform_from_bits(noise_bits(k1, k2, ids))
    key = score + noise[:, None] * -torch.log(-torch.log(u))
    best = key.amax(-1, keepdim=True)
    return torch.where(key == best, ids.expand_as(key), _NO_ID).amin(-1)


@jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@jit
def _race_kernel(score_ptr, score_stride, ids_ptr, ids_stride, k1_ptr, k2_ptr, noise_ptr, best_ptr, best_id_ptr,
                 n_cols, n_parts, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """One block of one row: its best key and the smallest id holding it, into [row, part]."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    score = tl.load(score_ptr + row * score_stride + cols, mask=inside, other=float("-inf"))
    if HAS_IDS:
        ids = tl.load(ids_ptr + row * ids_stride + cols, mask=inside, other=0)
    else:
        ids = cols.to(tl.int64)
    k1 = tl.load(k1_ptr + row).to(tl.uint32)
    k2 = tl.load(k2_ptr + row).to(tl.uint32)
    bits = _mix32_tl(_mix32_tl(ids.to(tl.uint32) ^ k1) ^ k2)
    u = ((bits >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
    if USE_LIBDEVICE:  # torch's CUDA log is libdevice's logf: the same bits as the reference there
        g = -libdevice.log(-libdevice.log(u))
    else:
        g = -tl.log(-tl.log(u))
    key = score + tl.load(noise_ptr + row) * g
    key = tl.where(inside, key, float("-inf"))
    best = tl.max(key, 0)
    best_id = tl.min(tl.where((key == best) & inside, ids, 1 << 62), 0)
    tl.store(best_ptr + row * n_parts + part, best)
    tl.store(best_id_ptr + row * n_parts + part, best_id)


def race_triton(score: torch.Tensor, ids: torch.Tensor | None, k1: torch.Tensor, k2: torch.Tensor,
                noise: torch.Tensor, block: int = RACE_BLOCK) -> torch.Tensor:
    m, n = score.shape
    score = score.contiguous()
    ids = None if ids is None else ids.contiguous()
    k1, k2, noise = k1.contiguous(), k2.contiguous(), noise.contiguous()  # [M] columns of the parameter buffers
    block = min(block, triton.next_power_of_2(max(n, 16)))
    parts = triton.cdiv(n, block)
    best = torch.empty(m, parts, dtype=torch.float32, device=score.device)
    best_id = torch.empty(m, parts, dtype=torch.int64, device=score.device)
    _race_kernel[(m, parts)](score, score.stride(0), score if ids is None else ids, 0 if ids is None else ids.stride(0),
                             k1, k2, noise, best, best_id, n, parts, HAS_IDS=ids is not None, BLOCK=block,
                             USE_LIBDEVICE=score.is_cuda, num_warps=max(1, min(8, block // 512)))
    top = best.amax(-1, keepdim=True)
    return torch.where(best == top, best_id, _NO_ID).amin(-1)


def race(score, ids, k1, k2, noise) -> torch.Tensor:
    if use_triton(score):
        return race_triton(score, ids, k1, k2, noise)
    if ids is not None and not score.is_cuda:
        # Sorted columns: the filters keep a prefix of each row and a -inf score never wins, so the CPU
        # (which reads the count for free) hashes noise for the longest kept prefix only.
        kept = int((score > float("-inf")).sum(-1).max())
        score, ids = score[:, :kept], ids[:, :kept]
    return race_ref(score, ids, k1, k2, noise)


# ---- the transforms ---------------------------------------------------------------------------------
def output_penalties(output: Sequence[int], presence: float, frequency: float) -> list[tuple[int, float]] | None:
    """OpenAI's presence and frequency penalties over the tokens generated so far, as (token id, value
    added to its logit): each token seen loses `presence` once and `frequency` per occurrence."""
    if not output or presence == 0.0 and frequency == 0.0:
        return None
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    return [(t, -(presence + frequency * c)) for t, c in counts.items()]


def _penalise(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL rule as `apply_repetition_penalty`, per row. Repeated ids write equal values, and rows with
    penalty 1 write back what they read, so padding and unused rows are harmless."""
    picked = x.gather(1, seen)
    return x.clone().scatter_(1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))


def _biased(x: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """x [M, V] plus each row's logit bias: ids/values [M, width], padded with (0, 0.0)."""
    return x.scatter_add(1, ids, values)


def _top_k_sorted(z: torch.Tensor, i: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`z.sort(descending=True, stable=True)` as far as a top-k filter of at most `top_k` reads it, for
    the CPU (a host check): the top_k + 1 largest of each row in the stable sort's order (value, then
    id), the rest of the sorted row -inf. The values are the full sort's wherever top-k keeps them, so
    the filtered scores are the same floats; the ids cover the candidates only. None when a row's k-th
    value ties the last candidate (values the full sort keeps may lie past it)."""
    w = min(top_k + 1, z.shape[1])
    _, idx = z.topk(w, dim=-1)
    idx = idx.sort(dim=-1).values  # the stable sort orders equal values by id
    sv, o = z.gather(1, idx).sort(dim=-1, descending=True, stable=True)
    if w < z.shape[1] and not bool((sv[:, w - 1 :] < sv.gather(1, i[:, _KTH : _KTH + 1])).all()):
        return None
    sz = torch.full_like(z, float("-inf"))
    sz[:, :w] = sv
    return sz, idx.gather(1, o)


def _filtered_scores(x: torch.Tensor, f: torch.Tensor, i: torch.Tensor, sort: bool, top_k: int = 0):
    """Temperature, top-k, top-p and min-p on penalised logits x [M, V]. Returns (score, ids): the
    scaled logits with dropped tokens at -inf, and the vocabulary id of each column (None: unsorted).
    A row's scores are the same floats on both paths: top-k/top-p are off there when unsorted, and
    min-p is decided in the logit domain (z_v - z_max < log min_p), which needs no order. `top_k`: every
    row's k is at most this; the CPU then sorts candidates only (`_top_k_sorted`) and the ids cover them,
    the scores past them being -inf."""
    z = x / f[:, _TEMP : _TEMP + 1]
    if not sort:
        drop = (z - z.amax(-1, keepdim=True)) < f[:, _LOG_MIN_P : _LOG_MIN_P + 1]
        return z.masked_fill(drop, float("-inf")), None
    top = _top_k_sorted(z, i, top_k) if top_k and not z.is_cuda else None
    sz, order = top if top is not None else z.sort(dim=-1, descending=True, stable=True)
    sz = sz.masked_fill(sz < sz.gather(1, i[:, _KTH : _KTH + 1]), float("-inf"))
    sp = sz.softmax(-1)
    # Keep the smallest prefix whose mass reaches top-p (the token crossing it included).
    drop = (sp.cumsum(-1) - sp) >= f[:, _TOP_P : _TOP_P + 1]
    drop |= (sz - sz[:, :1]) < f[:, _LOG_MIN_P : _LOG_MIN_P + 1]
    return sz.masked_fill(drop, float("-inf"))[:, : order.shape[1]], order


def _pick(x, f, i, plan: SamplePlan) -> torch.Tensor:
    if not plan.sample:
        return x.argmax(-1)
    score, ids = _filtered_scores(x, f, i, plan.sort, plan.top_k)
    return race(score, ids, i[:, _KEY1], i[:, _KEY2], f[:, _NOISE])


# ---- host packing -----------------------------------------------------------------------------------
def _pack(rows: Sequence[RowParams], vocab: int, f: np.ndarray, i: np.ndarray,
          pad_to: int) -> tuple[np.ndarray, bool, bool]:
    """Rows' parameters into f [>= pad_to, 5] fp32 and i [>= pad_to, 3] int64 (rows past len(rows):
    greedy, everything off). Returns (penalised row mask, any top-k/top-p row, any sampled row)."""
    m = len(rows)
    temp = np.array([r.temperature for r in rows], dtype=np.float64)
    top_k = np.array([r.top_k for r in rows], dtype=np.int64)
    top_p = np.array([r.top_p for r in rows], dtype=np.float64)
    min_p = np.array([r.min_p for r in rows], dtype=np.float64)
    penalty = np.array([r.repetition_penalty for r in rows], dtype=np.float64)
    penalised = np.array([r.repetition_penalty != 1.0 and r.seen is not None and len(r.seen) > 0 for r in rows],
                         dtype=bool)
    greedy = temp == 0.0
    k_on = ~greedy & (top_k > 0) & (top_k < vocab)
    p_on = ~greedy & (top_p < 1.0)
    min_on = ~greedy & (min_p > 0.0)
    f[:m, _TEMP] = np.where(greedy, 1.0, temp)
    f[:m, _TOP_P] = np.where(p_on, top_p, 2.0)
    f[:m, _LOG_MIN_P] = np.where(min_on, np.log(np.where(min_on, min_p, 1.0)), -np.inf)
    f[:m, _PENALTY] = np.where(penalised, penalty, 1.0)
    f[:m, _NOISE] = np.where(greedy, 0.0, 1.0)
    k1, k2 = _row_keys_np([r.seed for r in rows], [r.counter for r in rows], [r.stream for r in rows])
    i[:m, _KEY1], i[:m, _KEY2] = k1, k2
    i[:m, _KTH] = np.where(k_on, top_k - 1, vocab - 1)
    f[m:pad_to] = (1.0, 2.0, -np.inf, 1.0, 0.0)
    i[m:pad_to] = (0, 0, vocab - 1)
    return penalised, bool((k_on | p_on).any()), bool((~greedy).any())


def _seen_ids(r: RowParams, vocab: int, limit: int) -> np.ndarray:
    ids = np.asarray(r.seen, dtype=np.int64)
    if len(ids) > limit:
        ids = np.unique(ids)
        if len(ids) > limit:
            raise ValueError(f"{len(ids)} distinct seen tokens, more than max_seen={limit}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"seen token ids must be in [0, {vocab})")
    return ids


def _pack_seen(penalised: np.ndarray, seen: list[np.ndarray], out: np.ndarray) -> None:
    """Seen lists into out [R, width], each padded with its own first id. Rows that are not penalised
    keep whatever valid ids were there: with penalty 1 they change nothing."""
    for j, ids in zip(np.flatnonzero(penalised), seen):
        out[j, : len(ids)] = ids
        out[j, len(ids) :] = ids[0]


class DeviceSampler:
    """Batched sampler over preallocated per-row parameter buffers (pinned host, two sets for
    overlapped steps, and one device set). `sample` = `fill` (host) + `run` (device, no sync)."""

    def __init__(self, max_rows: int, vocab_size: int, device, max_seen: int = 4096, chunk_rows: int = 64,
                 batch_invariant: bool = False):
        self.max_rows, self.vocab, self.max_seen = max_rows, vocab_size, max_seen
        self.device = torch.device(device)
        self.chunk_rows = chunk_rows
        self.batch_invariant = batch_invariant  # logprobs' normaliser through `row_logsumexp`'s walk
        cuda = self.device.type == "cuda"
        self.h_f = [torch.zeros(max_rows, _N_FLOAT, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        self.h_i = [torch.zeros(max_rows, _N_INT, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        # Flat, so that a batch's [rows, width] prefix is contiguous and copies in one transfer.
        self.h_seen = [torch.zeros(max_rows * max_seen, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.d_f = torch.zeros(max_rows, _N_FLOAT, dtype=torch.float32, device=self.device)
        self.d_i = torch.zeros(max_rows, _N_INT, dtype=torch.int64, device=self.device)
        self.d_seen = torch.zeros(max_rows * max_seen, dtype=torch.int64, device=self.device)
        # Logit biases, [rows, width] flat; grown on the first batch that needs more (few requests set one).
        self.h_bias_ids: list[torch.Tensor] = []
        self.h_bias_val: list[torch.Tensor] = []
        self.d_bias_ids = self.d_bias_val = torch.zeros(0, device=self.device)
        # Each host set is refilled only after its previous copies have left it.
        self.copied: list[torch.cuda.Event | None] = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.next_set = 0

    def static_plan(self, rows: int) -> SamplePlan:
        """Every stage at full seen width: the plan a CUDA graph of `run` is captured with."""
        return SamplePlan(rows, self.max_seen, True, True)

    def fill(self, rows: Sequence[RowParams], pad_to: int | None = None, static: bool = False) -> SamplePlan:
        """Host half: parameters of `rows` (and neutral padding up to `pad_to`) into a pinned set, then
        queued copies to the device buffers on the current stream. `static`: for a graph captured
        with `static_plan(pad_to)`."""
        m = len(rows)
        r_total = m if pad_to is None else pad_to
        if not m <= r_total <= self.max_rows:
            raise ValueError(f"{m} rows padded to {r_total}: at most {self.max_rows}")
        s = self.next_set
        self.next_set ^= 1
        if self.copied[s] is not None:
            self.copied[s].synchronize()
        h_f, h_i = self.h_f[s], self.h_i[s]
        penalised, sort, sample = _pack(rows, self.vocab, h_f.numpy(), h_i.numpy(), r_total)
        seen = [_seen_ids(rows[j], self.vocab, self.max_seen) for j in np.flatnonzero(penalised)]
        width = self.max_seen if static else max((len(ids) for ids in seen), default=0)
        if seen:
            flat = self.h_seen[s].numpy()[: r_total * width].reshape(r_total, width)
            _pack_seen(penalised, seen, flat)
            used = (int(np.flatnonzero(penalised)[-1]) + 1) * width
            self.d_seen[:used].copy_(self.h_seen[s][:used], non_blocking=True)
        bias = self._fill_bias(rows, r_total, s)
        self.d_f[:r_total].copy_(h_f[:r_total], non_blocking=True)
        self.d_i[:r_total].copy_(h_i[:r_total], non_blocking=True)
        if self.copied[s] is not None:
            self.copied[s].record()
        if static:
            return dataclasses.replace(self.static_plan(r_total), bias=bias)
        kth = h_i.numpy()[:r_total, _KTH]
        top_k = int(kth.max()) + 1 if sort and r_total == m and kth.max() < self.vocab - 1 else 0
        return SamplePlan(r_total, width, sort, sample, top_k, bias)

    def _fill_bias(self, rows: Sequence[RowParams], r_total: int, s: int) -> int:
        """Rows' logit biases into pinned set `s` as [r_total, width] (padded with (0, 0.0), which adds
        nothing) and queued to the device; returns the width (0: no row has a bias)."""
        added = [r.added for r in rows]
        width = max((len(a) for a in added), default=0)
        if not width:
            return 0
        n = r_total * width
        if len(self.d_bias_ids) < n:
            size = max(n, 2 * len(self.d_bias_ids), 1024)
            cuda = self.device.type == "cuda"
            self.h_bias_ids = [torch.zeros(size, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
            self.h_bias_val = [torch.zeros(size, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
            self.d_bias_ids = torch.zeros(size, dtype=torch.int64, device=self.device)
            self.d_bias_val = torch.zeros(size, dtype=torch.float32, device=self.device)
        ids, val = self.h_bias_ids[s].numpy()[:n].reshape(r_total, width), self.h_bias_val[s].numpy()[:n].reshape(r_total, width)
        ids[:] = 0
        val[:] = 0.0
        for j, a in enumerate(added):
            if a:
                ids[j, : len(a)] = [t for t, _ in a]
                val[j, : len(a)] = [b for _, b in a]
        self.d_bias_ids[:n].copy_(self.h_bias_ids[s][:n], non_blocking=True)
        self.d_bias_val[:n].copy_(self.h_bias_val[s][:n], non_blocking=True)
        return width

    def transformed(self, logits: torch.Tensor, r0: int, plan: SamplePlan) -> torch.Tensor:
        """Rows r0.. of the last `fill` as the sampler reads them (fp32, biased, penalised): the
        distribution its picks and logprobs come from."""
        r1 = r0 + logits.shape[0]
        x = logits.float()
        if plan.bias:
            b = plan.bias
            ids = self.d_bias_ids[: plan.rows * b].view(plan.rows, b)[r0:r1]
            x = _biased(x, ids, self.d_bias_val[: plan.rows * b].view(plan.rows, b)[r0:r1])
        if plan.width:
            seen = self.d_seen[: plan.rows * plan.width].view(plan.rows, plan.width)[r0:r1]
            x = _penalise(x, seen, self.d_f[r0:r1, _PENALTY : _PENALTY + 1])
        return x

    def run(self, logits: torch.Tensor, plan: SamplePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Device half: (tokens [R] int64, logprobs [R] fp32) for logits [R, V] and the last `fill`.
        Logprobs are under the unfiltered softmax of the biased, penalised logits: x[t] - logsumexp(x)."""
        r_total = plan.rows
        if logits.shape != (r_total, self.vocab):
            raise ValueError(f"logits: expected [{r_total}, {self.vocab}], got {tuple(logits.shape)}")
        tokens = torch.empty(r_total, dtype=torch.int64, device=logits.device)
        logprobs = torch.empty(r_total, dtype=torch.float32, device=logits.device)
        for r0 in range(0, r_total, self.chunk_rows):
            r1 = min(r_total, r0 + self.chunk_rows)
            x = self.transformed(logits[r0:r1], r0, plan)
            f, i = self.d_f[r0:r1], self.d_i[r0:r1]
            tok = _pick(x, f, i, plan)
            tokens[r0:r1] = tok
            logprobs[r0:r1] = x.gather(1, tok[:, None])[:, 0] - row_logsumexp(x, self.batch_invariant)
        return tokens, logprobs

    def sample(self, logits: torch.Tensor, rows: Sequence[RowParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [M, V] (any float dtype) and rows[i] the parameters of row i → (tokens [M] int64,
        logprobs [M] fp32), both on the logits' device; nothing waits for the device."""
        return self.run(logits, self.fill(rows))


# ---- functional forms, for speculative verification ---------------------------------------------------
def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    # Pinned and asynchronous (a pageable upload would wait for the device); a stage's UpRing if any.
    return to_device(torch.from_numpy(a), device, torch.from_numpy(a[:0]).dtype)


def _packed(rows: Sequence[RowParams], vocab: int, device: torch.device):
    m = len(rows)
    f, i = np.zeros((m, _N_FLOAT), np.float32), np.zeros((m, _N_INT), np.int64)
    penalised, sort, sample = _pack(rows, vocab, f, i, m)
    seen = [_seen_ids(rows[j], vocab, 1 << 62) for j in np.flatnonzero(penalised)]
    seen_t = None
    if seen:
        s = np.zeros((m, max(len(ids) for ids in seen)), np.int64)
        _pack_seen(penalised, seen, s)
        seen_t = _to_device(s, device)
    return _to_device(f, device), _to_device(i, device), seen_t, sort, sample


def filtered_probs_batched(logits: torch.Tensor, rows: Sequence[RowParams]) -> torch.Tensor:
    """probs [M, V] fp32, row i as `filtered_probs(apply_repetition_penalty(apply_logit_bias(logits[i]),
    seen), params)`; a greedy row is one-hot at its argmax."""
    f, i, seen, sort, _ = _packed(rows, logits.shape[1], logits.device)
    x = logits.float()
    added = [r.added for r in rows]
    width = max((len(a) for a in added), default=0)
    if width:
        ids, val = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.float32)
        for j, a in enumerate(added):
            if a:
                ids[j, : len(a)], val[j, : len(a)] = [t for t, _ in a], [b for _, b in a]
        x = _biased(x, _to_device(ids, logits.device), _to_device(val, logits.device))
    if seen is not None:
        x = _penalise(x, seen, f[:, _PENALTY : _PENALTY + 1])
    score, order = _filtered_scores(x, f, i, sort)
    if order is not None:
        score = torch.empty_like(score).scatter_(1, order, score)
    probs = score.softmax(-1)
    greedy = (f[:, _NOISE] == 0)[:, None]
    one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def draw_from(probs: torch.Tensor, seeds: Sequence[int], counters: Sequence[int],
              stream: int | Sequence[int] = STREAM_SAMPLE) -> torch.Tensor:
    """One token per row of probs [M, V] (any non-negative weights) from the counter-based noise of
    (seeds[i], counters[i], stream): tokens [M] int64 on the probs' device."""
    m = probs.shape[0]
    streams = [stream] * m if isinstance(stream, int) else list(stream)
    k1, k2 = _row_keys_np(seeds, counters, streams)
    keys = _to_device(np.stack([k1, k2]).astype(np.int64), probs.device)
    noise = torch.ones(m, dtype=torch.float32, device=probs.device)
    return race(probs.float().log(), None, keys[0], keys[1], noise)


def verify_sampled_device(drafts: torch.Tensor, q: torch.Tensor, target_probs: torch.Tensor,
                          seeds: Sequence[int], counters: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling as `verify_sampled`, for B requests with k drafts each, on the
    device. drafts [B, k] int64; q [B, k, V] their draft distributions; target_probs [B, k+1, V];
    request b's token at depth j uses counter counters[b] + j (STREAM_SAMPLE: its acceptance uniform
    at index ACCEPT_INDEX, its residual or bonus draw over the vocabulary), so drafts must be drawn
    from another stream (STREAM_DRAFT). Returns (tokens [B, k+1], emitted [B]): row b's first
    emitted[b] tokens are the output (accepted drafts, then the residual or bonus token)."""
    b, k = drafts.shape
    dev = drafts.device
    seed_l = [s for s in seeds for _ in range(k + 1)]
    counter_l = [c + j for c in counters for j in range(k + 1)]
    k1, k2 = _row_keys_np(seed_l, counter_l, [STREAM_SAMPLE] * len(seed_l))
    accept_u = _uniform_np(k1, k2, ACCEPT_INDEX).reshape(b, k + 1)[:, :k]
    u = _to_device(np.ascontiguousarray(accept_u), dev)
    p_d = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0]
    # Accept with probability min(1, p/q): u < p/q, written without the division.
    accepted = (u * q_d < p_d).long().cumprod(1).sum(1)
    residual = (target_probs[:, :k] - q).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[:, :k])
    dists = torch.cat([residual, target_probs[:, k:]], 1).flatten(0, 1)
    keys = _to_device(np.stack([k1, k2]).astype(np.int64), dev)
    draws = race(dists.float().log(), None, keys[0], keys[1], torch.ones(b * (k + 1), device=dev)).view(b, k + 1)
    depth = torch.arange(k + 1, device=dev)
    padded = torch.cat([drafts, drafts[:, :1]], 1) if k else draws
    return torch.where(depth[None] < accepted[:, None], padded, draws), accepted + 1
