"""Quantizers: float weights → a format's raw GGUF blocks, for fidelity measurements and test files.

Q8_0 and Q4_0 use the gguf package's own quantizer. The gguf package only dequantizes Q4_K, IQ3_S and
Q6_K, so those are written here (IQ3_S's search has its own module, `iq3_s_quantize.py`). They are
simple, documented searches, not llama.cpp's importance-weighted ones, so their error is an upper
bound on what a llama.cpp file of the same format would show. Q5_K has no writer: the gguf package
only dequantizes it too.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

# Shrink factors of a sub-block's [min, max] range tried by the Q4_K writer: clipping the extremes a
# little often lowers the squared error of the other 30 values more than it costs the two.
Q4_K_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8)


def quantize(ggml_type: str, w: np.ndarray) -> np.ndarray:
    """Raw blocks [N, K / values per block × bytes per block] (uint8) of fp32 weights w [N, K]."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if ggml_type in ("Q8_0", "Q4_0"):
        return gguf_quantize(w, GGMLQuantizationType[ggml_type])
    if ggml_type == "Q4_K":
        return quantize_q4_k(w)
    if ggml_type == "IQ3_S":
        from strata.kernels.quant.iq3_s_quantize import quantize as quantize_iq3_s

        return quantize_iq3_s(w)
    if ggml_type == "Q6_K":
        return quantize_q6_k(w)
    raise ValueError(f"no quantizer for {ggml_type}")


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: per 256-value block an fp16 d and 16 int8 sub-block scales (16 values each); value =
    d·sc·(q − 32), q in 0..63. Each sub-block's scale puts its largest-magnitude value at −32 (that value
    exactly, the others rounded), the block's d fits the largest scale into ±127, and q is re-rounded
    against the scale actually stored. Packed as ggml lays it out: per 128-value half, value 32g + l
    (g = 0..3) keeps its low nibble in ql[l + 32·(g % 2)] (the high nibble of that byte when g ≥ 2) and
    its top two bits in qh[l] at bit 2g."""
    n, k = x.shape
    if k % 256:
        raise ValueError(f"Q6_K needs K % 256 == 0, got {k}")
    blocks = x.reshape(-1, 16, 16).astype(np.float32)  # [blocks, sub-blocks, values]
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    sub = -peak / 32.0
    d = (np.abs(sub).max(-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(sub, d32, out=np.zeros_like(sub), where=d32 != 0)), -128, 127).astype(np.int8)
    step = (d32 * sc.astype(np.float32))[..., None]
    q = np.rint(np.divide(blocks, step, out=np.zeros_like(blocks), where=step != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, half, g, l]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1)  # [blocks, half, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                          d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(n, k // 256 * 210)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K: per 256-value block fp16 d and dmin; per 32-value sub-block a 6-bit scale and min (value
    = d·sc·q − dmin·m, q in 0..15). Each sub-block's range [min(lo, 0), max] is shrunk by each of
    `Q4_K_SHRINK` and the one with the least squared error after rounding kept; the 6-bit codes are
    then fitted to the block's fp16 factors, and q re-rounded against the codes actually stored."""
    n, k = x.shape
    if k % 256:
        raise ValueError(f"K={k} is not a multiple of 256")
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    hi = sub.max(-1)
    best_err = np.full(lo.shape, np.inf, dtype=np.float32)
    scale, mins = np.zeros_like(lo), -lo
    for f in Q4_K_SHRINK:
        s = (hi - lo) * f / 15.0
        m = -lo * f
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.clip(np.rint(np.nan_to_num((sub + m[..., None]) / s[..., None])), 0, 15)
        err = ((q * s[..., None] - m[..., None] - sub) ** 2).sum(-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        scale, mins = np.where(better, s, scale), np.where(better, m, mins)
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.rint(scale / d.astype(np.float32)[:, None])).clip(0, 63).astype(np.uint8)
        m = np.nan_to_num(np.rint(mins / dmin.astype(np.float32)[:, None])).clip(0, 63).astype(np.uint8)
        eff_s = d.astype(np.float32)[:, None] * sc
        eff_m = dmin.astype(np.float32)[:, None] * m
        q = np.nan_to_num(np.rint((sub + eff_m[..., None]) / eff_s[..., None])).clip(0, 15).astype(np.uint8)
    # The 12 scale bytes: sub-blocks 0-3 keep their 6-bit scale and min in bytes 0-3 and 4-7 (top two
    # bits carrying bits 4-5 of sub-blocks 4-7); bytes 8-11 hold the low nibbles of sub-blocks 4-7.
    scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
    ], axis=1)
    # Each 32 bytes of quants: sub-block 2g in the low nibbles, 2g + 1 in the high ones.
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(n, k // 256 * 144)
