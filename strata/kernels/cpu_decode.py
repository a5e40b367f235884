"""C kernels for CPU steps of few rows (decodes): products, RMSNorm, q/k norm + RoPE and a gated MLP.

A small model's CPU decode step waits on two things torch does slowly at one row: its matrix products
(MKL's sgemv streams weights at ~8 GB/s on the AMD EPYC VM of docs/PERFORMANCE.md, where a plain loop
reaches 20-40) and the fixed cost of each op (a norm is ten dispatched ops). These loops, vectorized by
the compiler for the machine, do each in one call:

- `gemv`: out[m, n] = x[m, k] @ w[n, k].T (+ bias), fp32 rows against fp32 or bf16 weights, each bf16
  value widened to fp32 exactly (a 16-bit shift): a checkpoint stored in bf16 is read at half the bytes
  with its values unchanged.
- `add_rms_norm`: residual = x + residual; h = residual / rms(residual) * w.
- `qk_norm_rope`: the q and k heads of a q|k|v row normalised per head (each head's weight row) and
  rotated (rotate-half over the first rotary dims, cos/sin per row), written contiguous.
- `mlp`: out (+)= scale * down(silu(gate) * up) of one gate|up stack and down weight (an expert, a shared
  expert, a dense MLP); `moe`: a MoE layer's router, routing, chosen experts and shared expert.
- `decode_attention`: one query row per sequence over a paged fp32 K/V pool, its new K/V stored first.
- `span_attention`: few rows over a span of one sequence's positions in a paged pool of fp32, bf16 or int8
  (with per-token scales) K/V, read in place: each row's output and log-sum-exp, for a caller that
  splits a long span over threads and merges the parts (the host KV tier).

All sums are fp32 in the vectorized loops' order, not torch's: results agree with the references
(`*_ref`) to fp32 rounding, not bit for bit. The source is compiled once per machine with the system C
compiler (`cc -O3 -march=native`, under a second) into a cache directory and loaded through ctypes,
which releases the GIL for each call. Without a compiler, or where the build fails, `load` returns None
and callers keep torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("strata")

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float widen(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float same(float v) { return v; }

/* out[r * ldo + j] = sum_i w[j * k + i] * x[r * ldx + i] (+ bias[j]) for r < m, j < n: each weight row read
   once for all m rows of x. The dot product is left to the compiler's vectorizer (-fassociative-math). */
#define GEMV(NAME, T, LOAD)                                                                              \
void NAME(const T *w, const float *x, const float *bias, float *out, long m, long n, long k, long ldx,      \
          long ldo) {                                                                                   \
    for (long j = 0; j < n; j++) {                                                                      \
        const T *row = w + j * k;                                                                       \
        for (long r = 0; r < m; r++) {                                                                  \
            const float *xr = x + r * ldx;                                                              \
            float acc = 0.f;                                                                            \
            for (long i = 0; i < k; i++) acc += LOAD(row[i]) * xr[i];                                   \
            out[r * ldo + j] = bias ? acc + bias[j] : acc;                                              \
        }                                                                                               \
    }                                                                                                   \
}

GEMV(strata_gemv_bf16, uint16_t, widen)
GEMV(strata_gemv_f32, float, same)

static inline void norm_row(const float *x, float *h, const float *w, long d, float eps) {
    float ss = 0.f;
    for (long i = 0; i < d; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)d + eps);
    for (long i = 0; i < d; i++) h[i] = x[i] * r * w[i];
}

/* For rows t < n of width d: res_out = x + res (res NULL: x itself is the residual, res_out unused);
   h = res_out / rms(res_out) * w. */
void strata_add_rms_norm(const float *x, const float *res, float *res_out, float *h, const float *w, long n,
                         long d, float eps) {
    for (long t = 0; t < n; t++) {
        const float *src = x + t * d;
        if (res) {
            float *o = res_out + t * d;
            const float *rr = res + t * d;
            for (long i = 0; i < d; i++) o[i] = src[i] + rr[i];
            src = o;
        }
        norm_row(src, h + t * d, w, d, eps);
    }
}

/* Heads j < nh of rows t < n: src = qkv + t * ld + j * d; normalised by rms with weight row w + j * d
   (w NULL: no norm), then the first rd dims rotated (neox: x * cos + rotate_half(x) * sin, cos/sin rows of
   rd values per t), written to out + (t * nh + j) * d. */
void strata_qk_norm_rope(const float *qkv, long ld, float *out, const float *w, long n, long nh, long d, long rd,
                         const float *cos_t, const float *sin_t, float eps) {
    float tmp[1024];
    long half = rd / 2;
    for (long t = 0; t < n; t++) {
        const float *c = cos_t + t * rd, *s = sin_t + t * rd;
        for (long j = 0; j < nh; j++) {
            const float *src = qkv + t * ld + j * d;
            float *o = out + (t * nh + j) * d;
            if (w) norm_row(src, tmp, w + j * d, d, eps);
            else memcpy(tmp, src, d * sizeof(float));
            for (long i = 0; i < half; i++) o[i] = tmp[i] * c[i] - tmp[i + half] * s[i];
            for (long i = half; i < rd; i++) o[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
            for (long i = rd; i < d; i++) o[i] = tmp[i];
        }
    }
}

/* For rows t < m: out[t] = scale * down(silu(gate) * up) (accumulate: out[t] += ...), gate|up the 2 * inter
   outputs of w13 [2 * inter, k], down w2 [k_out, inter]; scratch holds 2 * inter floats (and is given
   k_out more). */
#define MLP(NAME, T, LOAD, GEMV_FN)                                                                      \
void NAME(const T *w13, const T *w2, const float *x, float *out, float *scratch, long m, long k, long inter, \
          long k_out, float scale, int accumulate) {                                                    \
    for (long t = 0; t < m; t++) {                                                                      \
        GEMV_FN(w13, x + t * k, 0, scratch, 1, 2 * inter, k, k, 2 * inter);                             \
        for (long i = 0; i < inter; i++) {                                                              \
            float g = scratch[i];                                                                       \
            scratch[i] = g / (1.f + expf(-g)) * scratch[inter + i];                                     \
        }                                                                                               \
        float *o = out + t * k_out;                                                                     \
        for (long j = 0; j < k_out; j++) {                                                              \
            const T *row = w2 + j * inter;                                                              \
            float acc = 0.f;                                                                            \
            for (long i = 0; i < inter; i++) acc += LOAD(row[i]) * scratch[i];                          \
            o[j] = accumulate ? o[j] + scale * acc : scale * acc;                                       \
        }                                                                                               \
    }                                                                                                   \
}

MLP(strata_mlp_bf16, uint16_t, widen, strata_gemv_bf16)
MLP(strata_mlp_f32, float, same, strata_gemv_f32)

/* One token's routing from its router logits, as the torch router: softmax, or sigmoid with a correction
   bias added for the choice only; the top k by value, descending (ties to the lower id); the weights (the
   softmax's or the sigmoid's) normalised to sum 1 if asked (sigmoid: + 1e-20), the sigmoid's scaled. */
static void route(const float *logits, long n_exp, long topk, int sigmoid, const float *corr, int norm,
                  float scale, long *ids, float *w) {
    float scores[n_exp], choice[n_exp];
    if (sigmoid) {
        for (long e = 0; e < n_exp; e++) {
            scores[e] = 1.f / (1.f + expf(-logits[e]));
            choice[e] = corr ? scores[e] + corr[e] : scores[e];
        }
    } else {
        float mx = logits[0], sum = 0.f;
        for (long e = 1; e < n_exp; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (long e = 0; e < n_exp; e++) sum += (scores[e] = expf(logits[e] - mx));
        for (long e = 0; e < n_exp; e++) choice[e] = scores[e] /= sum;
    }
    float total = 0.f;
    for (long j = 0; j < topk; j++) {
        long best = -1;
        for (long e = 0; e < n_exp; e++) {
            int taken = 0;
            for (long i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
        }
        ids[j] = best;
        total += (w[j] = scores[best]);
    }
    if (norm) for (long j = 0; j < topk; j++) w[j] /= sigmoid ? total + 1e-20f : total;
    if (sigmoid && scale != 1.f) for (long j = 0; j < topk; j++) w[j] *= scale;
}

/* The MoE layer for rows t < m of x [m, h]: router logits (fp32 router weight [n_exp, h]), routing, then
   out[t] = sum_j w_j * expert_{id_j}(x[t]) in choice order, plus the shared expert (sw13 non-NULL) after
   them. Experts are gate|up [2 * inter, h] and down [h, inter] stacks given by pointer; ids_out [m, topk]
   receives the choices. scratch holds 2 * max(inter, shared_inter) + h floats. */
#define MOE(NAME, T, MLP_FN)                                                                             \
void NAME(const float *x, float *out, long m, long h, const float *router, const float *corr, long n_exp,  \
          long topk, int sigmoid, int norm, float scale, const T *const *w13, const T *const *w2, long inter, \
          const T *sw13, const T *sw2, long shared_inter, float *scratch, long *ids_out) {             \
    float logits[n_exp], w[topk];                                                                       \
    long ids[topk];                                                                                     \
    for (long t = 0; t < m; t++) {                                                                      \
        const float *xt = x + t * h;                                                                    \
        strata_gemv_f32(router, xt, 0, logits, 1, n_exp, h, h, n_exp);                                  \
        route(logits, n_exp, topk, sigmoid, corr, norm, scale, ids, w);                                 \
        float *ot = out + t * h;                                                                        \
        for (long j = 0; j < topk; j++)                                                                 \
            MLP_FN(w13[ids[j]], w2[ids[j]], xt, ot, scratch, 1, h, inter, h, w[j], j > 0);              \
        if (sw13) MLP_FN(sw13, sw2, xt, ot, scratch, 1, h, shared_inter, h, 1.f, 1);                     \
        if (ids_out) memcpy(ids_out + t * topk, ids, topk * sizeof(long));                             \
    }                                                                                                   \
}

MOE(strata_moe_bf16, uint16_t, strata_mlp_bf16)
MOE(strata_moe_f32, float, strata_mlp_f32)

/* Decode attention over a paged K/V pool, one query row per sequence. For sequences r < n_seq: row r of
   k_new / v_new ([hkv, d] each, rows ldk / ldv apart) goes to slot slots[r] of the layer's pools kp / vp
   ([slots, hkv, d]); then for each query head h (kv head h / (hq / hkv)) out[r, h] = softmax(scale * q[r, h]
   . K_r) V_r over positions p < len, position p at slot blocks[r * ldb + p / bs] * bs + p % bs. scores
   holds len floats. */
void strata_decode_attention(float *kp, float *vp, const long *slots, const int *blocks, long ldb, long bs,
                             long len, long n_seq, const float *q, long ldq, const float *k_new, long ldk,
                             const float *v_new, long ldv, float *out, long hq, long hkv, long d, float scale,
                             float *scores) {
    long row = hkv * d, group = hq / hkv;
    for (long r = 0; r < n_seq; r++) {
        memcpy(kp + slots[r] * row, k_new + r * ldk, row * sizeof(float));
        memcpy(vp + slots[r] * row, v_new + r * ldv, row * sizeof(float));
    }
    for (long r = 0; r < n_seq; r++) {
        const int *table = blocks + r * ldb;
        for (long h = 0; h < hq; h++) {
            long g = h / group;
            const float *qh = q + r * ldq + h * d;
            float mx = -INFINITY;
            for (long p = 0; p < len; p++) {
                const float *key = kp + ((long)table[p / bs] * bs + p % bs) * row + g * d;
                float s = 0.f;
                for (long i = 0; i < d; i++) s += qh[i] * key[i];
                s *= scale;
                scores[p] = s;
                mx = s > mx ? s : mx;
            }
            float sum = 0.f;
            for (long p = 0; p < len; p++) sum += (scores[p] = expf(scores[p] - mx));
            float *o = out + (r * hq + h) * d;
            for (long i = 0; i < d; i++) o[i] = 0.f;
            for (long p = 0; p < len; p++) {
                const float *val = vp + ((long)table[p / bs] * bs + p % bs) * row + g * d;
                float w = scores[p] / sum;
                for (long i = 0; i < d; i++) o[i] += w * val[i];
            }
        }
    }
}

/* Attention of rows q [n, hq, d] (fp32, contiguous) over positions p0 <= p < p1 of one sequence in a paged
   pool (position p at slot blocks[p / bs] * bs + p % bs; a slot holds hkv heads of d values), every position
   visible to every row. Int8 pools scale each (slot, head) by ks / vs (NULL: no scales). Writes o [n, hq, d]
   (normalised) and lse [n, hq] (natural log), fp32. Keys are taken SPAN_TILE at a time: each slot's key and
   value heads are read in order and widened to fp32 once for all the n * (hq / hkv) query heads they serve,
   then one rescale of the running sums per tile. work holds n * hq * (SPAN_TILE + 2) + 2 * d floats. */
#define SPAN_TILE 32
#define SPAN_ATTENTION(NAME, T, LOAD)                                                                    \
void NAME(const T *kp, const T *vp, const float *ks, const float *vs, const long *blocks, long bs, long p0,  \
          long p1, const float *q, long n, long hq, long hkv, long d, float scale, float *o, float *lse,      \
          float *work) {                                                                                \
    long group = hq / hkv, rows = n * hq;                                                               \
    float *sc = work, *mx = work + rows * SPAN_TILE, *sum = mx + rows, *kf = sum + rows, *vf = kf + d;  \
    for (long rh = 0; rh < rows; rh++) {                                                                \
        for (long i = 0; i < d; i++) o[rh * d + i] = 0.f;                                               \
        mx[rh] = -INFINITY;                                                                             \
        sum[rh] = 0.f;                                                                                  \
    }                                                                                                   \
    for (long t0 = p0; t0 < p1; t0 += SPAN_TILE) {                                                      \
        long tn = p1 - t0 < SPAN_TILE ? p1 - t0 : SPAN_TILE;                                            \
        for (long t = 0; t < tn; t++) {                                                                 \
            long slot = blocks[(t0 + t) / bs] * bs + (t0 + t) % bs;                                     \
            for (long g = 0; g < hkv; g++) {                                                            \
                const T *key = kp + (slot * hkv + g) * d;                                               \
                float f = ks ? ks[slot * hkv + g] * scale : scale;                                      \
                for (long i = 0; i < d; i++) kf[i] = LOAD(key[i]);                                      \
                for (long r = 0; r < n; r++)                                                            \
                    for (long h = g * group; h < (g + 1) * group; h++) {                                \
                        const float *qr = q + (r * hq + h) * d;                                         \
                        float s = 0.f;                                                                  \
                        for (long i = 0; i < d; i++) s += qr[i] * kf[i];                                \
                        sc[(r * hq + h) * SPAN_TILE + t] = s * f;                                       \
                    }                                                                                   \
            }                                                                                           \
        }                                                                                               \
        for (long rh = 0; rh < rows; rh++) {                                                            \
            float *s = sc + rh * SPAN_TILE, m = mx[rh];                                                 \
            for (long t = 0; t < tn; t++) m = s[t] > m ? s[t] : m;                                      \
            float alpha = expf(mx[rh] - m), total = 0.f;                                                \
            for (long t = 0; t < tn; t++) total += (s[t] = expf(s[t] - m));                             \
            sum[rh] = sum[rh] * alpha + total;                                                          \
            mx[rh] = m;                                                                                 \
            if (alpha != 1.f)                                                                           \
                for (long i = 0; i < d; i++) o[rh * d + i] *= alpha;                                    \
        }                                                                                               \
        for (long t = 0; t < tn; t++) {                                                                 \
            long slot = blocks[(t0 + t) / bs] * bs + (t0 + t) % bs;                                     \
            for (long g = 0; g < hkv; g++) {                                                            \
                const T *val = vp + (slot * hkv + g) * d;                                               \
                float f = vs ? vs[slot * hkv + g] : 1.f;                                                \
                for (long i = 0; i < d; i++) vf[i] = LOAD(val[i]) * f;                                  \
                for (long r = 0; r < n; r++)                                                            \
                    for (long h = g * group; h < (g + 1) * group; h++) {                                \
                        float w = sc[(r * hq + h) * SPAN_TILE + t], *orow = o + (r * hq + h) * d;        \
                        for (long i = 0; i < d; i++) orow[i] += w * vf[i];                              \
                    }                                                                                   \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    for (long rh = 0; rh < rows; rh++) {                                                                \
        float inv = sum[rh] > 0.f ? 1.f / sum[rh] : 0.f;                                                \
        for (long i = 0; i < d; i++) o[rh * d + i] *= inv;                                              \
        lse[rh] = sum[rh] > 0.f ? mx[rh] + logf(sum[rh]) : -INFINITY;                                   \
    }                                                                                                   \
}

static inline float from_i8(int8_t v) { return (float)v; }
SPAN_ATTENTION(strata_span_attention_i8, int8_t, from_i8)
SPAN_ATTENTION(strata_span_attention_bf16, uint16_t, widen)
SPAN_ATTENTION(strata_span_attention_f32, float, same)

int strata_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The span cut into `parts` ranges of positions, one per thread of an OpenMP team (serial without
   OpenMP), each attended into its own rows of o_parts [parts, n, hq, d] and lse_parts [parts, n, hq] with
   its own work (work_stride floats apart); then merged by log-sum-exp in part order into o and lse. One
   call a layer: the threads never return to Python between the parts and the merge. */
#define SPAN_PARTS(NAME, ONE, T)                                                                         \
void NAME(const T *kp, const T *vp, const float *ks, const float *vs, const long *blocks, long bs, long p0,  \
          long p1, const float *q, long n, long hq, long hkv, long d, float scale, long parts,               \
          float *o_parts, float *lse_parts, float *work, long work_stride, float *o, float *lse) {          \
    long rows = n * hq;                                                                                 \
    _Pragma("omp parallel for num_threads(parts) schedule(static, 1)")                                  \
    for (long i = 0; i < parts; i++)                                                                    \
        ONE(kp, vp, ks, vs, blocks, bs, p0 + (p1 - p0) * i / parts, p0 + (p1 - p0) * (i + 1) / parts, q, n,  \
            hq, hkv, d, scale, o_parts + i * rows * d, lse_parts + i * rows, work + i * work_stride);     \
    for (long rh = 0; rh < rows; rh++) {                                                                \
        float m = -INFINITY, total = 0.f;                                                               \
        for (long i = 0; i < parts; i++) m = lse_parts[i * rows + rh] > m ? lse_parts[i * rows + rh] : m;  \
        float *out = o + rh * d;                                                                        \
        for (long j = 0; j < d; j++) out[j] = 0.f;                                                      \
        if (m == -INFINITY) { lse[rh] = -INFINITY; continue; }                                          \
        for (long i = 0; i < parts; i++) {                                                              \
            float w = expf(lse_parts[i * rows + rh] - m);                                               \
            const float *part = o_parts + (i * rows + rh) * d;                                          \
            for (long j = 0; j < d; j++) out[j] += w * part[j];                                         \
            total += w;                                                                                 \
        }                                                                                               \
        for (long j = 0; j < d; j++) out[j] /= total;                                                   \
        lse[rh] = m + logf(total);                                                                      \
    }                                                                                                   \
}

SPAN_PARTS(strata_span_parts_i8, strata_span_attention_i8, int8_t)
SPAN_PARTS(strata_span_parts_bf16, strata_span_attention_bf16, uint16_t)
SPAN_PARTS(strata_span_parts_f32, strata_span_attention_f32, float)
"""

# Not -ffast-math: linked into a shared library it can set flush-to-zero for the whole process.
FLAGS = ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno",
         "-shared", "-fPIC")
MAX_HEAD_DIM = 1024  # qk_norm_rope's row buffer
SPAN_TILE = 32  # keys per tile in span_attention (the C source's SPAN_TILE)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: F.linear in fp32 (a bf16 weight widened exactly)."""
    return F.linear(x, w.float(), bias)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    res = x if residual is None else x + residual
    return res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + eps) * w, res


def qk_norm_rope_ref(qkv: torch.Tensor, nh: int, d: int, w: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, eps: float) -> torch.Tensor:
    """qkv [n, >= nh * d]: its first nh heads normed (w [nh, d]) and rotated over cos/sin's [n, rd] dims."""
    x = qkv[:, : nh * d].reshape(-1, nh, d)
    if w is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    rd, half = cos.shape[-1], cos.shape[-1] // 2
    rot = x[..., :rd]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], x[..., rd:]], dim=-1)


def moe_ref(x: torch.Tensor, router: torch.Tensor, corr: torch.Tensor | None, top_k: int, sigmoid: bool,
            norm: bool, scale: float, w13: torch.Tensor, w2: torch.Tensor,
            shared: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, ids): the MoE layer of `MoeDecode` in torch, experts stacked [E, 2I, H] and [E, H, I]."""
    logits = F.linear(x, router)
    if sigmoid:
        scores = logits.sigmoid()
        ids = (scores if corr is None else scores + corr).topk(top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if norm else w
        w = w * scale
    else:
        w, ids = logits.softmax(-1).topk(top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True) if norm else w
    out = torch.stack([sum(w[t, j] * mlp_ref(x[t : t + 1], w13[e], w2[e])[0] for j, e in enumerate(ids[t].tolist()))
                       for t in range(x.shape[0])])
    if shared is not None:
        out = out + mlp_ref(x, *shared)
    return out, ids


def decode_attention_ref(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                         block_size: int, length: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`CpuKernels.decode_attention` in torch: the pools written, then SDPA over each sequence's positions."""
    k_pool[slots], v_pool[slots] = k, v
    pos = torch.arange(length)
    at = (blocks.long()[:, pos // block_size] * block_size + pos % block_size)  # [R, L] slots
    keys, values = k_pool[at].transpose(1, 2), v_pool[at].transpose(1, 2)  # [R, Hkv, L, D]
    o = F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=q.shape[1] != k.shape[1])
    return o[:, :, 0]


def span_attention_ref(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, blocks: torch.Tensor, block_size: int, p0: int, p1: int,
                       q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`CpuKernels.span_attention` in torch: the span's keys and values gathered and widened to fp32, then
    every row over all of them. Returns (o [n, Hq, D], lse [n, Hq])."""
    pos = torch.arange(p0, p1)
    slots = blocks.long()[pos // block_size] * block_size + pos % block_size
    k, v = k_pool[slots].float(), v_pool[slots].float()
    if k_scale is not None:
        k, v = k * k_scale[slots][..., None], v * v_scale[slots][..., None]
    n, hq, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("nhgd,khd->hgnk", q.float().view(n, hkv, hq // hkv, d), k) * scale
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("hgnk,khd->nhgd", torch.exp(s - lse[..., None]), v).reshape(n, hq, d)
    return o, lse.permute(2, 0, 1).reshape(n, hq)


def mlp_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = F.linear(x, w13.float())
    gate, up = h.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2.float())


def _fp32_rows(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()


class CpuKernels:
    """The compiled kernels. Activations are fp32 and contiguous (rows of unit stride for `gemv`'s x);
    weights fp32 or bf16, contiguous (`compact` makes them)."""

    def __init__(self, lib: ctypes.CDLL):
        vp, lg, fl, it = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
        sigs = {"gemv": [vp] * 4 + [lg] * 5, "mlp": [vp] * 5 + [lg] * 4 + [fl, it],
                "moe": [vp, vp, lg, lg, vp, vp, lg, lg, it, it, fl, vp, vp, lg, vp, vp, lg, vp, vp]}
        self.fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for kind, args in sigs.items():
            for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
                fn = getattr(lib, f"strata_{kind}_{suffix}")
                fn.argtypes, fn.restype = args, None
                self.fns[(kind, dtype)] = fn
        self._norm = lib.strata_add_rms_norm
        self._norm.argtypes, self._norm.restype = [vp] * 5 + [lg, lg, fl], None
        self._rope = lib.strata_qk_norm_rope
        self._rope.argtypes, self._rope.restype = [vp, lg, vp, vp, lg, lg, lg, lg, vp, vp, fl], None
        self._attn = lib.strata_decode_attention
        self._attn.argtypes = [vp, vp, vp, vp, lg, lg, lg, lg, vp, lg, vp, lg, vp, lg, vp, lg, lg, lg, fl, vp]
        self._attn.restype = None
        self._span: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, suffix in ((torch.int8, "i8"), (torch.bfloat16, "bf16"), (torch.float32, "f32")):
            fn = getattr(lib, f"strata_span_attention_{suffix}")
            fn.argtypes, fn.restype = [vp] * 5 + [lg] * 3 + [vp] + [lg] * 4 + [fl, vp, vp, vp], None
            self._span[dtype] = fn
        self._parts: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, suffix in ((torch.int8, "i8"), (torch.bfloat16, "bf16"), (torch.float32, "f32")):
            fn = getattr(lib, f"strata_span_parts_{suffix}")
            fn.argtypes, fn.restype = [vp] * 5 + [lg] * 3 + [vp] + [lg] * 4 + [fl, lg, vp, vp, vp, lg, vp, vp], None
            self._parts[dtype] = fn
        # Whether `span_attention_split` runs its parts on threads (OpenMP) rather than one after another.
        self.threaded_split = bool(lib.strata_openmp())

    @staticmethod
    def serves_decode_attention(k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor, q: torch.Tensor,
                                k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `decode_attention` takes these operands: fp32 pools [slots, Hkv, D] and rows, int32 block
        tables, heads of unit-stride rows laid out D apart."""
        return (k_pool.dtype == v_pool.dtype == q.dtype == k.dtype == v.dtype == torch.float32
                and k_pool.is_contiguous() and v_pool.is_contiguous() and blocks.dtype == torch.int32
                and blocks.stride(1) == 1 and k_pool.device.type == "cpu"
                and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v)))

    def decode_attention(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
                         block_size: int, length: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query row per sequence (q [R, Hq, D], k / v [R, Hkv, D]): k and v stored at `slots` (int64) of
        the pools, then each row's attention over the first `length` positions of its sequence (`blocks`
        [R, B], the block tables, `block_size` slots a block): `decode_attention_ref`. Returns [R, Hq, D]."""
        n_seq, hq, d = q.shape
        if slots.dtype != torch.long or not slots.is_contiguous() or slots.shape[0] != n_seq:
            raise ValueError("decode_attention takes one int64 slot per sequence")
        out = torch.empty(n_seq, hq, d, dtype=torch.float32)
        scores = torch.empty(max(length, 1), dtype=torch.float32)
        self._attn(k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), blocks.data_ptr(), blocks.stride(0),
                   block_size, length, n_seq, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                   v.stride(0), out.data_ptr(), hq, k.shape[1], d, d ** -0.5, scores.data_ptr())
        return out

    def serves_span_attention(self, k_pool: torch.Tensor) -> bool:
        """Whether `span_attention` reads a layer's pool of this kind: contiguous [slots, Hkv, D] host
        tensors of fp32, bf16 or int8."""
        return k_pool.dtype in self._span and k_pool.device.type == "cpu" and k_pool.is_contiguous()

    @staticmethod
    def span_work_numel(rows: int, hq: int, head_dim: int) -> int:
        """fp32 elements of `span_attention`'s scratch for `rows` query rows of `hq` heads."""
        return rows * hq * (SPAN_TILE + 2) + 2 * head_dim

    def span_attention(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, blocks: torch.Tensor, block_size: int, p0: int, p1: int,
                       q: torch.Tensor, scale: float, o: torch.Tensor, lse: torch.Tensor, work: torch.Tensor) -> None:
        """Rows q [n, Hq, D] (fp32, contiguous) over positions [p0, p1) of the sequence whose block table is
        `blocks` (int64), read in place from one layer's pools (k / v [slots, Hkv, D], int8 ones with
        k_scale / v_scale [slots, Hkv]): writes o [n, Hq, D] and lse [n, Hq] (`span_attention_ref`), using
        `work` (fp32, at least `span_work_numel` elements). Releases the GIL while it runs."""
        self._check_span(k_pool, v_pool, k_scale, blocks, block_size, p0, p1, q, o, lse, work)
        n, hq, d = q.shape
        scales = (None, None) if k_scale is None else (k_scale.data_ptr(), v_scale.data_ptr())
        self._span[k_pool.dtype](k_pool.data_ptr(), v_pool.data_ptr(), *scales, blocks.data_ptr(), block_size, p0,
                                 p1, q.data_ptr(), n, hq, k_pool.shape[1], d, scale, o.data_ptr(), lse.data_ptr(),
                                 work.data_ptr())

    def _check_span(self, k_pool, v_pool, k_scale, blocks, block_size, p0, p1, q, o, lse, work) -> None:
        n, hq, d = q.shape
        hkv = k_pool.shape[1]
        if not (q.dtype == o.dtype == lse.dtype == work.dtype == torch.float32 and q.is_contiguous()
                and o.is_contiguous() and lse.is_contiguous() and o.shape == q.shape and lse.shape == (n, hq)
                and v_pool.dtype == k_pool.dtype and v_pool.shape == k_pool.shape and v_pool.is_contiguous()
                and self.serves_span_attention(k_pool) and k_pool.shape[2] == d and hq % hkv == 0):
            raise ValueError("span_attention takes contiguous fp32 rows and outputs over a contiguous host pool")
        if blocks.dtype != torch.long or not blocks.is_contiguous() or not 0 <= p0 <= p1 <= blocks.numel() * block_size:
            raise ValueError("span_attention takes an int64 block table that covers the span")
        if (k_scale is None) != (k_pool.dtype != torch.int8) or work.numel() < self.span_work_numel(n, hq, d):
            raise ValueError("span_attention: int8 pools take their scales, others none; work is too small")

    def span_attention_split(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
                             v_scale: torch.Tensor | None, blocks: torch.Tensor, block_size: int, p0: int, p1: int,
                             q: torch.Tensor, scale: float, o_parts: torch.Tensor, lse_parts: torch.Tensor,
                             work: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        """`span_attention` over [p0, p1) cut into len(o_parts) equal ranges, one per thread where the
        library has OpenMP (`threaded_split`), merged by log-sum-exp into o [n, Hq, D] and lse [n, Hq]:
        o_parts [P, n, Hq, D], lse_parts [P, n, Hq] (contiguous) and work [P, W] (rows of unit stride, W ≥
        `span_work_numel`) are each part's.
        One call, the GIL released throughout."""
        parts = o_parts.shape[0]
        self._check_span(k_pool, v_pool, k_scale, blocks, block_size, p0, p1, q, o, lse, work[0])
        n, hq, d = q.shape
        if not (parts >= 1 and o_parts.shape == (parts, n, hq, d) and lse_parts.shape == (parts, n, hq)
                and work.shape[0] == parts and work.stride(1) == 1
                and all(t.dtype == torch.float32 for t in (o_parts, lse_parts, work))
                and o_parts.is_contiguous() and lse_parts.is_contiguous()):
            raise ValueError("span_attention_split takes contiguous fp32 rows for each of its parts")
        scales = (None, None) if k_scale is None else (k_scale.data_ptr(), v_scale.data_ptr())
        self._parts[k_pool.dtype](k_pool.data_ptr(), v_pool.data_ptr(), *scales, blocks.data_ptr(), block_size, p0,
                                  p1, q.data_ptr(), n, hq, k_pool.shape[1], d, scale, parts, o_parts.data_ptr(),
                                  lse_parts.data_ptr(), work.data_ptr(), work.stride(0), o.data_ptr(), lse.data_ptr())

    def gemv(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        if not (x.dtype == torch.float32 and x.stride(1) == 1 and w.is_contiguous() and w.shape[1] == k):
            raise ValueError("gemv takes fp32 rows of unit stride and a contiguous [n, k] weight")
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        self.fns[("gemv", w.dtype)](w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                    out.data_ptr(), m, n, k, x.stride(0), out.stride(0))
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * w, x + residual); with no residual x is the residual."""
        n, d = x.shape
        if not (_fp32_rows(x) and (residual is None or _fp32_rows(residual)) and w.is_contiguous()):
            raise ValueError("add_rms_norm takes contiguous fp32 rows")
        h = torch.empty(n, d, dtype=torch.float32)
        res = x if residual is None else torch.empty(n, d, dtype=torch.float32)
        self._norm(x.data_ptr(), None if residual is None else residual.data_ptr(), res.data_ptr(), h.data_ptr(),
                   w.data_ptr(), n, d, eps)
        return h, res

    def qk_norm_rope(self, qkv: torch.Tensor, nh: int, d: int, w: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, eps: float) -> torch.Tensor:
        """[n, nh, d]: `qk_norm_rope_ref`."""
        n = qkv.shape[0]
        rd = cos.shape[-1]
        if not (qkv.dtype == torch.float32 and qkv.stride(-1) == 1 and d <= MAX_HEAD_DIM and rd <= d
                and cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32
                and (w is None or (w.is_contiguous() and w.shape == (nh, d)))):
            raise ValueError("qk_norm_rope takes fp32 q|k|v rows and contiguous fp32 cos/sin tables")
        out = torch.empty(n, nh, d, dtype=torch.float32)
        self._rope(qkv.data_ptr(), qkv.stride(0), out.data_ptr(), None if w is None else w.data_ptr(), n, nh, d, rd,
                   cos.data_ptr(), sin.data_ptr(), eps)
        return out


def _dropped() -> None:
    return None


class Prepared:
    """An object made from a model's weights as they were (copies, raw pointers): a copy or a pickle of
    the model gets None in its place, and is packed again to get its own."""

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self):
        return _dropped, ()


class Product(Prepared):
    """One weight's products through the kernels, its pointers taken once: `product(x)` is
    `gemv(x, w, bias)` with less per-call work (a decode step makes dozens). The product keeps its weight
    and bias alive."""

    def __init__(self, kernels: CpuKernels, w: torch.Tensor, bias: torch.Tensor | None = None):
        if not (w.dim() == 2 and w.is_contiguous() and w.dtype in (torch.float32, torch.bfloat16)
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))):
            raise ValueError(f"unsupported weight for the CPU kernels: {tuple(w.shape)} {w.dtype}")
        self.w, self.bias = w, bias
        self.n, self.k = w.shape
        self._fn = kernels.fns[("gemv", w.dtype)]
        self._w, self._b = w.data_ptr(), None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if x.stride(1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty(m, self.n, dtype=torch.float32)
        self._fn(self._w, x.data_ptr(), self._b, out.data_ptr(), m, self.n, self.k, x.stride(0), out.stride(0))
        return out


class GatedMlp(Prepared):
    """`down(silu(gate) * up)` of one gate|up stack `w13` [2I, H] and `w2` [H_out, I] in one call:
    `mlp(x)`, or `mlp(x, out, scale, accumulate=True)` adding `scale` times it into `out`."""

    def __init__(self, kernels: CpuKernels, w13: torch.Tensor, w2: torch.Tensor):
        if not (w13.is_contiguous() and w2.is_contiguous() and w13.dtype == w2.dtype
                and w13.dtype in (torch.float32, torch.bfloat16) and w2.shape[1] * 2 == w13.shape[0]):
            raise ValueError("GatedMlp takes contiguous [2I, H] and [H_out, I] weights of one dtype")
        self.w13, self.w2 = w13, w2
        self.k, self.inter, self.k_out = w13.shape[1], w2.shape[1], w2.shape[0]
        self._fn = kernels.fns[("mlp", w13.dtype)]
        self._w13, self._w2 = w13.data_ptr(), w2.data_ptr()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0,
                 accumulate: bool = False) -> torch.Tensor:
        if not _fp32_rows(x):
            x = x.float().contiguous()
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, self.k_out, dtype=torch.float32)
        scratch = torch.empty(2 * self.inter + self.k_out, dtype=torch.float32)
        self._fn(self._w13, self._w2, x.data_ptr(), out.data_ptr(), scratch.data_ptr(), m, self.k, self.inter,
                 self.k_out, scale, accumulate)
        return out


class MoeDecode(Prepared):
    """A MoE layer's decode rows in one call: router logits, routing (`route` in the source: softmax, or
    sigmoid with a correction bias and a scale; no expert groups), each chosen expert's gated MLP
    weighted in choice order, then the shared expert. `moe(x)` -> (out [m, H], ids [m, k])."""

    def __init__(self, kernels: CpuKernels, router: torch.Tensor, corr: torch.Tensor | None, top_k: int, sigmoid: bool,
                 norm: bool, scale: float, w13: torch.Tensor, w2: torch.Tensor,
                 shared: tuple[torch.Tensor, torch.Tensor] | None):
        """`w13` [E, 2I, H], `w2` [E, H, I], `shared` (gate|up, down) of one dtype (`compact`); `router`
        fp32 [E, H]; `corr` fp32 [E] or None."""
        dtypes = {w13.dtype, w2.dtype} | ({shared[0].dtype, shared[1].dtype} if shared else set())
        if len(dtypes) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
            raise ValueError("MoeDecode takes contiguous expert stacks of one dtype")
        self.keep = (router.contiguous(), None if corr is None else corr.float().contiguous(), w13, w2, shared)
        self.n_exp, self.inter, self.h = w13.shape[0], w2.shape[2], w13.shape[2]
        self.top_k, self.sigmoid, self.norm, self.scale = top_k, sigmoid, norm, scale
        ptrs = ctypes.c_void_p * self.n_exp
        self._w13 = ptrs(*[w13[e].data_ptr() for e in range(self.n_exp)])
        self._w2 = ptrs(*[w2[e].data_ptr() for e in range(self.n_exp)])
        self.shared_inter = shared[1].shape[1] if shared else 0
        self._fn = kernels.fns[("moe", w13.dtype)]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not _fp32_rows(x):
            x = x.float().contiguous()
        m = x.shape[0]
        router, corr, _, _, shared = self.keep
        out = torch.empty(m, self.h, dtype=torch.float32)
        ids = torch.empty(m, self.top_k, dtype=torch.long)
        scratch = torch.empty(2 * max(self.inter, self.shared_inter) + self.h, dtype=torch.float32)
        self._fn(x.data_ptr(), out.data_ptr(), m, self.h, router.data_ptr(), None if corr is None else corr.data_ptr(),
                 self.n_exp, self.top_k, self.sigmoid, self.norm, self.scale, self._w13, self._w2, self.inter,
                 shared[0].data_ptr() if shared else None, shared[1].data_ptr() if shared else None,
                 self.shared_inter, scratch.data_ptr(), ids.data_ptr())
        return out, ids


def compact(*ws: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Weights as the kernels read them, contiguous: bf16 where that holds every value of all of them
    exactly (a checkpoint stored in bf16), else fp32. One weight in, one out; several, a tuple of one dtype."""
    fp32 = [w.detach().float().contiguous() for w in ws]
    # bf16 is fp32's top half: a value is exact in bf16 when its low 16 bits are zero.
    exact = not any(bool((w.view(torch.int32) & 0xFFFF).any()) for w in fp32)
    out = tuple(w.to(torch.bfloat16) for w in fp32) if exact else tuple(fp32)
    return out[0] if len(out) == 1 else out


_lock = threading.Lock()
_loaded: dict[Path, CpuKernels | None] = {}


def _machine_key() -> str:
    """What `-march=native` compiles for: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def load(cache_dir: Path) -> CpuKernels | None:
    """The kernels, compiled into `cache_dir` on first use (keyed by source, flags and CPU), or None where
    there is no C compiler or the build fails (logged once)."""
    cache_dir = Path(cache_dir)
    with _lock:
        if cache_dir not in _loaded:
            _loaded[cache_dir] = _build(cache_dir)
        return _loaded[cache_dir]


def _build(cache_dir: Path) -> CpuKernels | None:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    failure: Exception | None = None
    # With OpenMP where the compiler has it (the split span's threads); the library then shares the OpenMP
    # runtime torch has loaded (same soname), so its team is torch's pool. Without it, the same source.
    for extra in (("-fopenmp",), ()):
        key = hashlib.sha256("\0".join((SOURCE, *FLAGS, *extra, _machine_key())).encode()).hexdigest()[:16]
        path = cache_dir / f"cpu_decode-{key}.so"
        try:
            if not path.exists():
                if cc is None:
                    log.info("no C compiler: CPU decode steps keep torch's ops")
                    return None
                cache_dir.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                    src, lib = Path(tmp) / "cpu_decode.c", Path(tmp) / "cpu_decode.so"
                    src.write_text(SOURCE)
                    subprocess.run([cc, *FLAGS, *extra, "-o", str(lib), str(src), "-lm"], check=True,
                                   capture_output=True, timeout=120)
                    os.replace(lib, path)  # atomic: a process building the same key at once reads a whole file
            return CpuKernels(ctypes.CDLL(str(path)))
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            failure = e
    detail = getattr(failure, "stderr", b"") or b""
    log.warning("CPU decode kernels unavailable (%s%s); CPU decode steps keep torch's ops", failure,
                f": {detail.decode(errors='replace')[:300]}" if detail else "")
    return None
