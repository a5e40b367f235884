"""Q6_K's planes as torch and the kernels read them (their layout: `q6_k.py`'s docstring): the check
of a weight's planes, its 6-bit quants in K order, and the planes as the kernels' int32-word
arguments. `q6_k.py` (the definition, the dequantizing kernels and the dispatch) and `q6_k_dp4a.py`
(the dp4a GEMV) both read them here, so the dp4a module needs nothing of the format module that
dispatches to it."""

from __future__ import annotations

import torch

from strata.kernels.quant.kquant_host import check_planes


def check_q6k_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> None:
    check_planes("Q6_K", planes, k, {"ql": ((n, k // 2), torch.uint8), "qh": ((n, k // 4), torch.uint8),
                                     "scales": ((n, k // 16), torch.int8), "d": ((n, k // 256), torch.float32)})


def quants(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """The 6-bit quants q (0..63), uint8 [N, K] in K order."""
    check_q6k_planes(planes, n, k)
    halves = k // 128
    ql = planes["ql"].view(n, halves, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1)  # [N, halves, 128]: values j, then 64 + j
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=ql.device).view(1, 1, 4, 1)
    high = ((planes["qh"].view(n, halves, 1, 32) >> shifts) & 3).view(n, halves, 128)  # values 32t + i
    return (low | (high << 4)).view(n, k)


def kernel_planes(planes: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The kernels' plane arguments: ql, qh and scales as int32 words, d."""
    return (planes["ql"].view(torch.int32), planes["qh"].view(torch.int32), planes["scales"].view(torch.int32),
            planes["d"])
