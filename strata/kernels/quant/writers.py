"""Quantizers: float weights → a format's raw GGUF blocks, for fidelity measurements and test files.

Q8_0 uses the gguf package's own quantizer. The gguf package only dequantizes Q4_K and IQ3_S, so
those are written here (IQ3_S's search lives beside its kernels, `iq3_s.quantize`). They are simple,
documented searches, not llama.cpp's importance-weighted ones, so their error is an upper bound on
what a llama.cpp file of the same format would show.
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
    if ggml_type == "Q8_0":
        return gguf_quantize(w, GGMLQuantizationType.Q8_0)
    if ggml_type == "Q4_K":
        return quantize_q4_k(w)
    if ggml_type == "IQ3_S":
        from strata.kernels.quant.iq3_s import quantize as quantize_iq3_s

        return quantize_iq3_s(w)
    raise ValueError(f"no quantizer for {ggml_type}")


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
