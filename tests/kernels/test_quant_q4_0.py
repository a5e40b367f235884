"""Q4_0 (strata/kernels/quant/q4_0.py) beyond the checks every format passes
(tests/kernels/test_quant_formats.py): what its 32-value blocks allow, K that 256 does not divide (96:
32-value K steps and the d plane read as fp16; 320: 64-value steps, d read as words) in `matmul`, the
configurations' K steps, the dequantize-into kernel's and the MoE decode kernels' 32-value K steps, and
the Q4_0 writer (gguf's own quantizer), whose blocks this module reads back as gguf does.

Tolerances of the product: tests/kernels/test_quant_formats.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_formats import DEV, DTYPE_IDS, DTYPES, Q40, run_poisoned, seed_of

from strata.kernels.quant import q4_0

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 24, 96), (3, 40, 320), (16, 33, 96), (40, 24, 320)])
def test_matmul_at_k_that_256_does_not_divide(m, n, k, dtype):
    """K = 96 (32-value K steps, d read as fp16) and 320 (64-value steps, d read as words), through
    `matmul` (GEMV for M ≤ 16, GEMM above), x a column slice (a row stride wider than K)."""
    _, planes = Q40.weight(n, k, seed_of("oddk", m, n, k))
    wide = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(seed_of("x", m, k))).to(DEV, dtype)
    x = wide[:, 32:]
    out = run_poisoned(q4_0.matmul, x, n, planes, n, k)
    Q40.check_product(out, x, planes, n, k)
    assert q4_0.d_words(k, q4_0.gemv_config(n, k).block_k) == (k % 64 == 0)


def test_configurations_divide_k():
    """The K step is the largest power of two up to the configuration's that divides K, at least 32."""
    assert q4_0.gemv_config(4096, 4096).block_k == 128 and q4_0.gemv_config(4096, 12288).block_k == 256
    assert q4_0.gemv_config(4096, 2880).block_k == 64 and q4_0.gemv_config(64, 96).block_k == 32
    assert q4_0.gemm_config(512, 4096, 1120).block_k == 32
    assert q4_0.gemm_config(512, 4096, 1152, torch.float32).block_k == 64
    assert q4_0.gemm_config(512, 4096, 1152).block_k == 128


def test_dequantize_into_tiles_take_32_value_k_steps():
    from strata.kernels.quant.dequant import block_k_for

    assert block_k_for("Q4_0", 160, 256) == 32 and block_k_for("Q4_0", 320, 256) == 64


def test_moe_decode_down_kernel_takes_32_value_k_steps_at_i_96():
    from strata.kernels.quant import moe_decode_q as mdq

    assert mdq.decode_config("Q4_0", 256, 96).down_block_k == 32


def test_the_writer_makes_blocks_read_back_as_gguf_reads_them():
    """gguf's own quantizer writes the blocks; a QWeight of them dequantizes to gguf's bits, within 4
    bits a value of the input."""
    from strata.kernels.quant import QWeight
    from strata.kernels.quant.writers import quantize

    w = (np.random.default_rng(6).standard_normal((6, 320)) * 0.02).astype(np.float32)
    raw = quantize("Q4_0", w)
    assert raw.shape == (6, 10 * q4_0.BLOCK_BYTES) and raw.dtype == np.uint8
    back = QWeight.from_raw("Q4_0", torch.from_numpy(raw), 6, 320).dequantize()
    assert torch.equal(back.view(torch.int32), Q40.gguf_bits(raw))
    assert (back - torch.from_numpy(w)).norm() / np.linalg.norm(w) < 0.15  # 4 bits a value
