"""Q3_K (strata/kernels/quant/q3_k.py) beyond the checks every format passes
(tests/kernels/test_quant_formats.py): its block layout against hand-written references, value by
value for the quants and bit by bit for the repacked scales.
"""

from __future__ import annotations

import numpy as np
from test_quant_formats import Q3K, repacked, seed_of

from strata.kernels.quant import q3_k


def test_repacked_scales_follow_the_block_layout():
    """Scale i of a block: nibble i // 8 of byte 96 + i % 8, with bits 2(i // 4) and 2(i // 4) + 1 of
    byte 104 + i % 4 above it, less 32."""
    n, k = 10, 768
    raw, planes = repacked(Q3K, n, k)
    blocks = raw.reshape(n, -1, q3_k.BLOCK_BYTES)
    scales = planes["scales"].cpu().numpy().reshape(n, -1, 16)
    for i in range(16):
        low = (blocks[:, :, 96 + i % 8] >> (4 * (i // 8))) & 15
        high = (blocks[:, :, 104 + i % 4] >> (2 * (i // 4))) & 3
        assert np.array_equal(scales[:, :, i], (low | (high << 4)).astype(np.int32) - 32)


def test_quants_follow_the_block_layout():
    """Value 128h + 32s + j of a block: low bits 2s, 2s+1 of qs byte 32h + j, high bit 4h + s of hmask
    byte j (the docstring's layout, value by value)."""
    n, k = 3, 512
    raw, planes = Q3K.weight(n, k, seed_of("layout"), device="cpu")
    blocks = raw.reshape(n, -1, q3_k.BLOCK_BYTES).astype(np.int32)
    got = q3_k.quants(planes, n, k).numpy().reshape(n, -1, 256)
    for h in range(2):
        for s in range(4):
            for j in range(32):
                low = (blocks[:, :, 32 + 32 * h + j] >> (2 * s)) & 3
                high = (blocks[:, :, j] >> (4 * h + s)) & 1
                assert np.array_equal(got[:, :, 128 * h + 32 * s + j], low | (high << 2))
