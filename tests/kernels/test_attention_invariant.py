"""The paged attention kernel's invariant mode (`invariant=True`): one tile shape for every
step and key splits of INVARIANT_SPLIT_KEYS at absolute positions, merged in order. A query row gets
the same bits as a decode row with the splits as programs of their own, as the last row of a prompt
chunk whose programs walk their splits, and beside other sequences.

CPU: the interpreter in fp32 (its dots are the same BLAS calls at the same tile shapes in every path,
so bitwise equality is meaningful there too), splits shrunk to one key tile. GPU (`pytest -m gpu`):
bf16 at real shapes, where the MMA instruction is the thing under test."""

from __future__ import annotations

import pytest
import torch
from test_attention import MIXED, check, make_case, run, seed_of, workspace_for

from strata.kernels import attention as A

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def invariant(case, num_splits=1, workspace=None):
    return run(lambda *a, **kw: A.paged_attention_triton(*a, invariant=True, **kw), case, num_splits, workspace)


@pytest.fixture
def short_splits(monkeypatch):
    """Splits of one 64-key tile, so contexts of a few hundred keys split several ways."""
    monkeypatch.setattr(A, "INVARIANT_SPLIT_KEYS", 64)


@pytest.mark.parametrize("int8", [False, True])
def test_matches_the_reference_with_splits_as_programs_or_walked(short_splits, int8):
    case, seqs, q_start = make_case(seed_of("inv-mixed", int8), MIXED, hkv=2, group=2, head_dim=16, block_size=4,
                                    dtype=torch.float32, int8=int8)
    ref = run(A.paged_attention_ref, case)
    splits = cdiv(max(ctx for _, ctx in seqs), A.INVARIANT_SPLIT_KEYS)
    ws = workspace_for(case, splits)
    check(invariant(case, splits, ws), ref, seqs, q_start, 1e-5)
    assert not ws.counters.any()
    check(invariant(case), ref, seqs, q_start, 1e-5)


def _one_row_as(case, row: int, ctx: int, shape):
    """A case whose sequence 0 is `shape` = (q_len, ctx) with the same keys as `case`'s sequence 0 and
    its last query row equal to `case`'s row `row` (a query at position ctx - 1)."""
    n, c = shape
    assert c == ctx
    other = dict(case)
    q = torch.randn(n + 2, *case["q"].shape[1:], generator=torch.Generator().manual_seed(5)).to(case["q"].dtype)
    q[n - 1] = case["q"][row]
    other.update(q=q, q_start=torch.tensor([0], dtype=torch.int32), q_len=torch.tensor([n], dtype=torch.int32),
                 ctx_len=torch.tensor([c], dtype=torch.int32), block_tables=case["block_tables"][:1].clone(),
                 max_q_len=n)
    return other


@pytest.mark.parametrize("int8", [False, True])
def test_a_row_is_the_same_decoded_verified_or_read_in_a_chunk(short_splits, int8):
    """Position 149 of a 150-key context: the last row of a 40-row chunk beside other sequences (programs
    walk their splits), a decode row alone (splits as programs, and walked), a verify step's last row."""
    case, seqs, q_start = make_case(seed_of("inv-rows", int8), MIXED, hkv=2, group=2, head_dim=16, block_size=4,
                                    dtype=torch.float32, int8=int8)
    (n0, ctx0), row = seqs[0], q_start[0] + seqs[0][0] - 1
    assert (n0, ctx0) == (40, 150)
    chunk = invariant(case)[row]
    splits = cdiv(ctx0, A.INVARIANT_SPLIT_KEYS)
    for shape in ((1, 150), (3, 150)):
        one = _one_row_as(case, row, ctx0, shape)
        ws = workspace_for(one, splits)
        last = shape[0] - 1
        assert torch.equal(invariant(one, splits, ws)[last], chunk), f"{shape} with splits as programs"
        assert torch.equal(invariant(one)[last], chunk), f"{shape} walking its splits"


def test_the_default_mode_is_not_invariant_here(monkeypatch):
    """The same comparison without the mode, with its split rule (splits sized from each context) and
    the narrow prompt tile against the decode tile: the chunk's row and the decode row differ, so the
    test above can fail."""
    monkeypatch.setattr(A, "MIN_SPLIT_KEYS", 16)
    case, seqs, q_start = make_case(seed_of("inv-rows", False), MIXED, hkv=2, group=2, head_dim=16, block_size=4,
                                    dtype=torch.float32)
    row = q_start[0] + seqs[0][0] - 1
    chunk = run(A.paged_attention_triton, case)[row]
    one = _one_row_as(case, row, 150, (1, 150))
    ws = workspace_for(one, 8)
    assert not torch.equal(run(A.paged_attention_triton, one, 8, ws)[0], chunk)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("int8", [False, True])
def test_gpu_bf16_rows_the_same_in_every_regime(int8):
    """Qwen3-8B heads (8 KV heads x 4, dim 128), bf16: position 2999 of a 3000-key context read as the
    last row of a 1024-row chunk, decoded alone (splits as programs and walked), verified (4 rows)."""
    seqs = [(1024, 3000), (1, 777), (5, 40)]
    case, seqs, q_start = make_case(seed_of("inv-gpu", int8), seqs, hkv=8, group=4, head_dim=128, block_size=16,
                                    dtype=torch.bfloat16, int8=int8, device="cuda")
    row = q_start[0] + 1023
    chunk = invariant(case)[row]
    ref = run(A.paged_attention_ref, case)
    check(invariant(case), ref, seqs, q_start, 2e-2)
    splits = cdiv(3000, A.INVARIANT_SPLIT_KEYS)
    for shape in ((1, 3000), (4, 3000)):
        one = _one_row_as({k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}, row, 3000, shape)
        one = {k: v.cuda() if torch.is_tensor(v) else v for k, v in one.items()}
        ws = workspace_for(one, splits)
        assert torch.equal(invariant(one, splits, ws)[shape[0] - 1], chunk), shape
        assert torch.equal(invariant(one)[shape[0] - 1], chunk), shape
