"""The grammar token-mask kernel against its torch reference (bit-exact: it only writes -inf).

Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET) at small shapes;
the `gpu` tests add a 152K vocabulary at batch 8 under CUDA-graph capture, replayed with new masks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.kernels.token_mask import apply_token_mask, apply_token_mask_ref, apply_token_mask_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _bitmask(rows: int, vocab: int, seed: int, words: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = words or (vocab + 31) // 32
    return torch.randint(-2**31, 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32).to(DEV)


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g).to(dtype).to(DEV)


def _both(logits, bitmask, active=None):
    a, b = logits.clone(), logits.clone()
    apply_token_mask_triton(a, bitmask, active)
    apply_token_mask_ref(b, bitmask, active)
    return a, b


def test_reference_follows_the_bits():
    logits = torch.zeros(2, 40)
    bitmask = torch.tensor([[0b1011, 0], [-1, 1 << 7]], dtype=torch.int32)
    apply_token_mask_ref(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 1, 3]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(32)) + [39]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(dtype):
    rows, vocab = 4, 1100  # not a multiple of 32, two blocks per row
    bitmask = _bitmask(rows, vocab, seed=0)
    bitmask[1] = -1  # a row without a grammar
    bitmask[3, :32] = -1  # a block of a row with every token allowed
    logits = _logits(rows, vocab, dtype)
    out, ref = _both(logits, bitmask)
    assert torch.equal(out, ref)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3, :1024], logits[3, :1024])
    assert torch.isinf(out).sum() > 1000


def test_rows_are_chosen_by_a_tensor_or_a_count():
    rows, vocab = 4, 300
    bitmask, logits = _bitmask(rows, vocab, seed=2), _logits(rows, vocab, torch.float32)
    active = torch.tensor([1, 0, 0, 1], dtype=torch.int32, device=DEV)
    out, ref = _both(logits, bitmask, active)
    assert torch.equal(out, ref) and torch.equal(out[1:3], logits[1:3]) and torch.isinf(out[0]).any()
    out, ref = _both(logits, bitmask, 2)
    assert torch.equal(out, ref) and torch.equal(out[2:], logits[2:]) and torch.isinf(out[1]).any()
    out, _ = _both(logits, bitmask, 0)
    assert torch.equal(out, logits)


def test_strided_logits_and_a_wider_bitmask():
    rows, vocab = 3, 200
    wide = _logits(rows, vocab + 56, torch.float32)
    bitmask = _bitmask(5, vocab, seed=3, words=10)  # more rows and words than needed: both ignored
    a, b = wide.clone(), wide.clone()
    apply_token_mask_triton(a[:, :vocab], bitmask)
    apply_token_mask_ref(b[:, :vocab], bitmask)
    assert torch.equal(a, b) and torch.equal(a[:, vocab:], wide[:, vocab:])


def test_dispatch_and_shape_checks():
    logits, bitmask = _logits(2, 64, torch.float32), _bitmask(2, 64, seed=4)
    ref = apply_token_mask_ref(logits.clone(), bitmask)
    assert torch.equal(apply_token_mask(logits.clone(), bitmask), ref)
    for bad in (lambda: apply_token_mask_ref(logits, bitmask[:, :1]),  # too few words
                lambda: apply_token_mask_ref(logits, bitmask.long()),
                lambda: apply_token_mask_ref(logits, bitmask[:1]),
                lambda: apply_token_mask_ref(logits.long(), bitmask),
                lambda: apply_token_mask_ref(logits, bitmask, 3),
                lambda: apply_token_mask_ref(logits, bitmask, torch.ones(3, dtype=torch.int32, device=DEV))):
        with pytest.raises(ValueError):
            bad()


def test_a_grammar_mask_leaves_only_its_tokens():
    """A mask filled by a GrammarMatcher through a numpy view of the host buffer, then applied."""
    from strata.grammar import GrammarCompiler, GrammarSpec
    from strata.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(Path(__file__).resolve().parents[2] / "strata" / "assets" / "default-model")
    compiler = GrammarCompiler(tok, 8192, threads=1)
    host = torch.full((2, compiler.mask_words), -1, dtype=torch.int32)
    m = compiler.matcher(GrammarSpec.regex("(yes|no)"))
    m.fill_mask(host.numpy()[0])
    logits = _logits(2, 8192, torch.float32)
    out = apply_token_mask(logits.clone(), host.to(DEV))
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and all(m.copy().accept(t) for t in allowed)
    assert torch.equal(out[1], logits[1])
    assert tok.decode([int(out[0].argmax())]) in ("y", "ye", "yes", "n", "no")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_vocab_in_a_cuda_graph(dtype):
    rows, vocab = 8, 151936
    logits = torch.empty(rows, vocab, dtype=dtype, device=DEV)
    source = _logits(rows, vocab, dtype)
    bitmask = torch.empty(rows, (vocab + 31) // 32, dtype=torch.int32, device=DEV)
    host = torch.empty_like(bitmask, device="cpu").pin_memory()

    def step():
        logits.copy_(source)
        bitmask.copy_(host, non_blocking=True)
        apply_token_mask_triton(logits, bitmask)

    host.copy_(_bitmask(rows, vocab, seed=5).cpu())
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (6, 7):
        new = _bitmask(rows, vocab, seed=seed).cpu()
        new[seed % rows] = -1
        host.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = apply_token_mask_ref(source.clone(), new.to(DEV))
        assert torch.equal(logits, ref)
        assert torch.equal(logits[seed % rows], source[seed % rows])
