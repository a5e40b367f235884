"""Q4_K's planes as torch reads them (their layout: `q4_k.py`'s docstring): the check of a weight's
planes and the exact fp32 fields of each pair of sub-blocks. `q4_k.py` (the definition, the
dequantizing kernels and the dispatch) and `q4_k_dp4a.py` (the dp4a GEMV's reference) both read them
here, so the dp4a module needs nothing of the format module that dispatches to it."""

from __future__ import annotations

import torch

from strata.kernels.quant.kquant_host import check_planes


def check_q4k_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> None:
    check_planes("Q4_K", planes, k, {"qs": ((n, k // 2), torch.uint8), "scales": ((n, k // 16), torch.uint8),
                                     "d_dmin": ((n, k // 128), torch.float16)})


def pair_fields(planes: dict[str, torch.Tensor], n: int, k: int):
    """Per 64-value pair of sub-blocks, all fp32 and exact: quants [N, K/64, 2, 32] (the low nibbles'
    sub-block, then the high ones'), the fields [N, K/64, 4] (scale lo, scale hi, min lo, min hi) and
    the super-block's d and dmin [N, K/64] each."""
    check_q4k_planes(planes, n, k)
    qs = planes["qs"].view(n, k // 64, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).float()
    fields = planes["scales"].view(n, k // 64, 4).float()
    d_dmin = planes["d_dmin"].view(n, k // 256, 2).float().repeat_interleave(4, dim=1)
    return q, fields, d_dmin[..., 0], d_dmin[..., 1]
