"""The batch-invariant row log-sum-exp (`strata.kernels.row_lse`) against torch.logsumexp, and its claim:
a row's value is bitwise the same alone and among other rows.

Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET) at small shapes;
the `gpu` test uses a 152K vocabulary and batches of 1 to 64 rows.
"""

from __future__ import annotations

import pytest
import torch

from strata.kernels.row_lse import BLOCK, row_logsumexp, row_logsumexp_ref, row_logsumexp_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _logits(rows: int, vocab: int, seed: int, masked: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    if masked:  # grammar-masked rows: most entries -inf
        x[torch.rand(rows, vocab, generator=g) < masked] = float("-inf")
        x[:, 0] = 1.0  # at least one allowed token per row
    return x.to(DEV)


@pytest.mark.parametrize("vocab", [7, BLOCK, BLOCK + 3, 3 * BLOCK - 100])
@pytest.mark.parametrize("masked", [0.0, 0.9])
def test_both_match_torch(vocab, masked):
    x = _logits(5, vocab, seed=vocab, masked=masked)
    want = torch.logsumexp(x, -1)
    torch.testing.assert_close(row_logsumexp_ref(x), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row_logsumexp_triton(x), want, rtol=1e-6, atol=1e-6)


def test_a_row_of_minus_infinity_gives_minus_infinity():
    x = torch.full((2, BLOCK + 5), float("-inf"), device=DEV)
    x[1, -1] = 0.0
    for fn in (row_logsumexp_ref, row_logsumexp_triton):
        out = fn(x).tolist()
        assert out[0] == float("-inf") and out[1] == 0.0


def test_a_row_alone_equals_the_row_in_a_batch_bitwise():
    x = _logits(9, 2 * BLOCK + 17, seed=3)
    for invariant_fn in (row_logsumexp_ref, row_logsumexp_triton):
        batch = invariant_fn(x)
        for i in (0, 4, 8):
            assert torch.equal(invariant_fn(x[i : i + 1]), batch[i : i + 1])


def test_dispatch_is_torch_unless_invariant():
    x = _logits(3, 100, seed=5)
    assert torch.equal(row_logsumexp(x, False), torch.logsumexp(x, -1))
    torch.testing.assert_close(row_logsumexp(x, True), torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_vocabulary_152k_rows_alone_and_in_batches():
    x = _logits(64, 151936, seed=11)
    want = torch.logsumexp(x.double(), -1).float()
    for rows in (1, 2, 8, 64):
        got = row_logsumexp(x[:rows], True)
        torch.testing.assert_close(got, want[:rows], rtol=1e-6, atol=1e-6)
        for i in range(rows):
            assert torch.equal(got[i : i + 1], row_logsumexp(x[i : i + 1], True)), (rows, i)
