"""IQ4_XS (strata/kernels/quant/iq4_xs.py) beyond the checks every format passes
(tests/kernels/test_quant_formats.py): its non-linear value table (gguf's IQ4_NL one) and its scales'
bit layout as repacked, against a hand-written reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_quant_formats import IQ4XS, repacked

from strata.kernels.quant import iq4_xs

gguf = pytest.importorskip("gguf")


def test_values_are_gguf_iq4_nl_table():
    assert iq4_xs.KVALUES.tolist() == [float(v) for v in gguf.quants.IQ4_NL.kvalues]


def test_repacked_scales_follow_the_block_layout():
    """Scale of sub-block j: nibble j % 2 of byte 4 + j // 2, with bits 2j, 2j + 1 of the 16-bit
    scales_h (bytes 2-3) above it, less 32."""
    n, k = 10, 768
    raw, planes = repacked(IQ4XS, n, k)
    blocks = raw.reshape(n, -1, iq4_xs.BLOCK_BYTES)
    scales = planes["scales"].cpu().numpy().reshape(n, -1, 8)
    high = blocks[:, :, 2:4].copy().view(np.uint16)[..., 0]
    for j in range(8):
        low = (blocks[:, :, 4 + j // 2] >> (4 * (j % 2))) & 15
        expect = (low | (((high >> (2 * j)) & 3) << 4)).astype(np.int32) - 32
        assert np.array_equal(scales[:, :, j], expect)
