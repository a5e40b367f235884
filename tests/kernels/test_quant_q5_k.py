"""Q5_K (strata/kernels/quant/q5_k.py) beyond the checks every format passes
(tests/kernels/test_quant_formats.py): its planes are Q4_K's of the same block without the high bits
(qh), and the MoE decode kernels take it for as many tokens as Q4_K.
"""

from __future__ import annotations

import numpy as np
import torch
from test_quant_formats import Q5K, repacked

from strata.kernels.quant import moe_decode_q as mdq
from strata.kernels.quant import q4_k, q5_k


def test_planes_are_q4_k_planes_of_the_block_without_qh():
    n, k = 10, 768
    raw, planes = repacked(Q5K, n, k)
    blocks = raw.reshape(n, -1, q5_k.BLOCK_BYTES)
    as_q4_k = np.concatenate([blocks[:, :, :16], blocks[:, :, 48:]], axis=-1).reshape(n, -1)
    for name, plane in q4_k.repack(torch.from_numpy(as_q4_k)).items():
        assert torch.equal(planes[name].cpu(), plane), name


def test_moe_decode_takes_as_many_tokens_as_for_q4_k():
    for fmt in ("Q4_K", "Q5_K"):
        assert mdq.supported(8, 2, fmt, 256, 256, torch.bfloat16)
        assert not mdq.supported(9, 2, fmt, 256, 256, torch.bfloat16)
