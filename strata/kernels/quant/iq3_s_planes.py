"""The IQ3_S grid and the reading of a weight's two exact factors, shared by the format module
(`iq3_s.py`: planes, definition, dequantizing kernels, dispatch), its dp4a GEMV (`iq3_s_dp4a.py`) and
the kernels that dequantize IQ3_S tiles (`dequant.py`, `moe_q.py`, `moe_decode_q.py`). The planes'
layout is `iq3_s.py`'s docstring.

The grid: gguf's 512 entries of four magnitudes (odd integers 1-15) as one int32 word each, byte j
holding magnitude j (`GRID_WORDS`, a 2 KB table; `grid_table` on a device). The kernels load it once a
program (`grid_table_words`) and gather words from it with tl.gather (`grid_words`), which Triton lowers
through shared memory, instead of 64 random global loads a thread per step through L1. Against loads
from the global table, on the H200: the dp4a GEMV 1.04-1.07x as fast at 128-row tiles
(bench/results/iq3s_grid_cuda.txt), batch-1 decode 205.0 tok/s against 201.7 at 8B shapes, the grouped
MoE kernel's dequantizing tile 1.22x at the 30B-A3B shape (docs/QUANTIZATION.md).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from strata.kernels.triton_import import jit, tl


def _grid_words() -> torch.Tensor:
    """int32 [512]: gguf's IQ3_S grid, entry i's 4 magnitudes as bytes 0..3 of word i."""
    from gguf.quants import IQ3_S as GgufIQ3S

    GgufIQ3S.init_grid()
    mags = np.asarray(GgufIQ3S.grid, dtype=np.float32).reshape(512, 4)
    assert np.array_equal(mags, np.round(mags)) and mags.min() >= 1 and mags.max() <= 15
    mags = mags.astype(np.int32)
    words = mags[:, 0] | (mags[:, 1] << 8) | (mags[:, 2] << 16) | (mags[:, 3] << 24)
    return torch.from_numpy(words.astype(np.int32))


GRID_WORDS = _grid_words()  # CPU; `grid_table` puts it on a device
# Interleaved sign planes (`iq3_s.interleave_signs`): value v's sign at bit 8 (v % 4) + v // 4 of its
# sub-block's word.
SIGN_BIT = torch.tensor([8 * (v % 4) + v // 4 for v in range(32)], dtype=torch.int32)


@lru_cache(maxsize=16)
def grid_table(device: torch.device) -> torch.Tensor:
    """The grid on `device` (made once per device; `iq3_s.repack` makes it, so never first under capture)."""
    return GRID_WORDS.to(device)


@lru_cache(maxsize=16)
def sign_bits(device: torch.device) -> torch.Tensor:
    """`SIGN_BIT` on `device`, made once: no copy from the host in a step, so the dequantization can be
    captured in a CUDA graph (a step that embeds tokens from a table kept quantized)."""
    return SIGN_BIT.to(device)


def signed_quants(planes: dict[str, torch.Tensor], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid magnitude times sign, ±{1, 3, ..., 15} as fp32 [N, K/32, 32]; d · (1 + 2 · scale) fp32
    [N, K/32]): the two exact factors of every weight."""
    qs, qh, signs = planes["qs"].long(), planes["qh"].long(), planes["signs"]
    device = qs.device
    high = ((qh.view(n, k // 32, 1) >> torch.arange(8, device=device)) & 1).view(n, k // 4)
    mags = (grid_table(device)[qs | (high << 8)].unsqueeze(-1) >> torch.arange(0, 32, 8, device=device)) & 0xFF
    negative = (signs.view(n, k // 32, 1) >> sign_bits(device)) & 1
    # The sign is a multiplication, as gguf's, so a zero d keeps gguf's sign of zero.
    values = mags.float().view(n, k // 32, 32) * (1.0 - 2.0 * negative.float())
    scale = ((planes["scales"].view(n, k // 64, 1).int() >> torch.arange(0, 8, 4, device=device)) & 15).view(n, k // 32)
    return values, planes["d"].float().repeat_interleave(8, dim=1) * (1 + 2 * scale).float()


@jit
def grid_table_words(grid_ptr, LOAD: tl.constexpr):
    """The 512 grid words in registers, once a program, for `grid_words` to gather from; 0 without
    LOAD (a kernel serving several formats loads the table for IQ3_S only)."""
    if LOAD:
        return tl.load(grid_ptr + tl.arange(0, 512))
    else:
        return 0


@jit
def grid_words(idx, table):
    """The grid words at `idx` (int32, any shape, 0..511), gathered from `table` (`grid_table_words`)."""
    flat = tl.reshape(idx, (idx.numel,))
    return tl.reshape(tl.gather(table, flat, 0), idx.shape)
