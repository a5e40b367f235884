"""The CPU decode kernels (C, built with the system compiler) against their torch references."""

from __future__ import annotations

import pytest
import torch

from strata.kernels import cpu_decode


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    k = cpu_decode.load(tmp_path_factory.mktemp("kernels"))
    if k is None:
        pytest.skip("no C compiler to build the CPU decode kernels")
    return k


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 2e-6) -> bool:
    return bool((got - want).abs().max() <= rtol * want.abs().max() + 1e-6)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(512, 256), (7, 100), (13, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_linear(kernels, m, n, k, dtype):
    torch.manual_seed(m * n + k)
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(m, k + 5)[:, :k]  # rows of unit stride, wider apart than k
    bias = torch.randn(n)
    for b in (None, bias):
        assert _close(kernels.gemv(x, w, b), cpu_decode.gemv_ref(x, w, b))
    out = torch.zeros(m, n + 3)
    cpu_decode.Product(kernels, w.contiguous(), bias)(x, out[:, :n])
    assert _close(out[:, :n], cpu_decode.gemv_ref(x, w, bias)) and not out[:, n:].any()


def test_add_rms_norm(kernels):
    torch.manual_seed(0)
    x, res, w = torch.randn(3, 256) * 4, torch.randn(3, 256), torch.randn(256)
    for r in (None, res):
        h, out_res = kernels.add_rms_norm(x, r, w, 1e-5)
        want_h, want_res = cpu_decode.add_rms_norm_ref(x, r, w, 1e-5)
        assert torch.equal(out_res, want_res) and _close(h, want_h)
    assert kernels.add_rms_norm(x, None, w, 1e-5)[1] is x  # no residual yet: x itself


@pytest.mark.parametrize("rotary", [32, 64])
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope(kernels, rotary, norm):
    torch.manual_seed(rotary)
    n, nqk, nheads, d = 3, 6, 8, 64
    qkv = torch.randn(n, nheads * d) * 3
    w = torch.randn(nqk, d) if norm else None
    angles = torch.randn(n, rotary // 2) * 10
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    got = kernels.qk_norm_rope(qkv, nqk, d, w, cos, sin, 1e-6)
    assert got.shape == (n, nqk, d)
    assert _close(got, cpu_decode.qk_norm_rope_ref(qkv, nqk, d, w, cos, sin, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mlp_scales_and_accumulates(kernels, dtype):
    torch.manual_seed(3)
    w13, w2 = (torch.randn(256, 128) * 0.1).to(dtype), (torch.randn(128, 128) * 0.1).to(dtype)
    x = torch.randn(2, 128)
    mlp = cpu_decode.GatedMlp(kernels, w13, w2)
    want = cpu_decode.mlp_ref(x, w13, w2)
    assert _close(mlp(x), want)
    out = torch.ones(2, 128)
    mlp(x, out, 0.25, accumulate=True)
    assert _close(out, 1 + 0.25 * want)
    mlp(x, out, 0.5)
    assert _close(out, 0.5 * want)


def test_compact_keeps_values():
    exact = torch.randn(8, 16).bfloat16().float()
    assert cpu_decode.compact(exact).dtype == torch.bfloat16
    assert torch.equal(cpu_decode.compact(exact).float(), exact)
    inexact = exact + 1e-4
    assert cpu_decode.compact(inexact).dtype == torch.float32


def test_built_once_per_cache_dir_and_none_without_a_compiler(tmp_path, monkeypatch):
    first = cpu_decode.load(tmp_path / "a")
    if first is None:
        pytest.skip("no C compiler")
    assert cpu_decode.load(tmp_path / "a") is first
    assert len(list((tmp_path / "a").glob("cpu_decode-*.so"))) == 1
    monkeypatch.setattr(cpu_decode.shutil, "which", lambda name: None)
    assert cpu_decode.load(tmp_path / "b") is None


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_matches_its_reference(kernels, scoring, dtype):
    torch.manual_seed(5)
    n_exp, h, inter = 8, 64, 32
    router = torch.randn(n_exp, h)
    corr = torch.randn(n_exp) * 0.1 if scoring == "sigmoid" else None
    w13, w2 = (torch.randn(n_exp, 2 * inter, h) * 0.2).to(dtype), (torch.randn(n_exp, h, inter) * 0.2).to(dtype)
    shared = ((torch.randn(2 * inter, h) * 0.2).to(dtype), (torch.randn(h, inter) * 0.2).to(dtype))
    x = torch.randn(5, h)
    for sh in (None, shared):
        moe = cpu_decode.MoeDecode(kernels, router, corr, 2, scoring == "sigmoid", True, 2.5, w13, w2, sh)
        out, ids = moe(x)
        want, want_ids = cpu_decode.moe_ref(x, router, corr, 2, scoring == "sigmoid", True, 2.5, w13, w2, sh)
        assert torch.equal(ids, want_ids)
        assert _close(out, want, 1e-5)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)])
def test_decode_attention_matches_sdpa_over_the_pool(kernels, hq, hkv):
    torch.manual_seed(hq + hkv)
    bs, d, n_blocks = 4, 16, 12
    k_pool, v_pool = torch.randn(n_blocks * bs, hkv, d), torch.randn(n_blocks * bs, hkv, d)
    blocks = torch.randperm(n_blocks - 1)[:6].add(1).view(2, 3).int()  # two sequences, shuffled blocks
    length = 10
    slots = (blocks[:, (length - 1) // bs].long() * bs + (length - 1) % bs).contiguous()
    qkv = torch.randn(2, hq + 2 * hkv, d)  # rows of q|k|v heads, as the model's projection leaves them
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    assert kernels.serves_decode_attention(k_pool, v_pool, blocks, q, k, v)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want = cpu_decode.decode_attention_ref(want_k, want_v, slots, blocks, bs, length, q, k, v)
    got = kernels.decode_attention(k_pool, v_pool, slots, blocks, bs, length, q, k, v)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    assert _close(got, want, 1e-5)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("hq,hkv,d,n", [(16, 2, 64, 1), (4, 4, 32, 3), (6, 2, 16, 2)])
def test_span_attention_reads_a_paged_pool_in_place(kernels, kind, hq, hkv, d, n):
    """Rows over spans of one sequence's positions (whole, inside a block, across blocks and tiles, one key)
    in a shuffled block table: the reference's output and log-sum-exp; scratch reused between calls."""
    from strata.kvcache.pool import make_pool

    torch.manual_seed(hq * 31 + d + n)
    bs, nb = 8, 12
    pool = make_pool("auto" if kind == "fp32" else kind, 2, nb, bs, hkv, d, "cpu", torch.float32)
    pool.write(1, torch.arange(nb * bs), torch.randn(nb * bs, hkv, d), torch.randn(nb * bs, hkv, d))
    scales = (pool.k_scale[1], pool.v_scale[1]) if kind == "int8" else (None, None)
    blocks = torch.randperm(nb)
    q = torch.randn(n, hq, d)
    o, lse = torch.empty(n, hq, d), torch.empty(n, hq)
    work = torch.empty(kernels.span_work_numel(n, hq, d))
    assert kernels.serves_span_attention(pool.k[1])
    for p0, p1 in [(0, nb * bs), (2, 7), (5, 77), (40, 41)]:
        kernels.span_attention(pool.k[1], pool.v[1], *scales, blocks, bs, p0, p1, q, d ** -0.5, o, lse, work)
        want_o, want_lse = cpu_decode.span_attention_ref(pool.k[1], pool.v[1], *scales, blocks, bs, p0, p1, q,
                                                         d ** -0.5)
        assert _close(o, want_o, 1e-5) and _close(lse, want_lse, 1e-5)
    with pytest.raises(ValueError, match="block table"):
        kernels.span_attention(pool.k[1], pool.v[1], *scales, blocks, bs, 0, nb * bs + 1, q, 0.1, o, lse, work)
    with pytest.raises(ValueError, match="too small"):
        kernels.span_attention(pool.k[1], pool.v[1], *scales, blocks, bs, 0, 4, q, 0.1, o, lse, work[:8])


@pytest.mark.parametrize("kind", ["fp32", "int8"])
@pytest.mark.parametrize("parts", [1, 3, 5])
def test_span_attention_split_merges_its_parts(kernels, kind, parts):
    """A span cut into parts (on threads where the library has OpenMP), merged by log-sum-exp in one call:
    the reference over the whole span, also where a part holds no position (5 parts of 4 positions)."""
    from strata.kvcache.pool import make_pool

    torch.manual_seed(parts)
    bs, nb, n, hq, hkv, d = 8, 12, 2, 8, 2, 32
    pool = make_pool("auto" if kind == "fp32" else kind, 2, nb, bs, hkv, d, "cpu", torch.float32)
    pool.write(1, torch.arange(nb * bs), torch.randn(nb * bs, hkv, d) * 3, torch.randn(nb * bs, hkv, d))
    scales = (pool.k_scale[1], pool.v_scale[1]) if kind == "int8" else (None, None)
    blocks = torch.randperm(nb)
    q = torch.randn(n, hq, d)
    o, lse = torch.empty(n, hq, d), torch.empty(n, hq)
    o_parts, lse_parts = torch.empty(parts, n, hq, d), torch.empty(parts, n, hq)
    work = torch.empty(parts, kernels.span_work_numel(n, hq, d))
    for p0, p1 in [(0, nb * bs), (3, 90), (10, 14)]:
        kernels.span_attention_split(pool.k[1], pool.v[1], *scales, blocks, bs, p0, p1, q, d ** -0.5, o_parts,
                                     lse_parts, work, o, lse)
        want_o, want_lse = cpu_decode.span_attention_ref(pool.k[1], pool.v[1], *scales, blocks, bs, p0, p1, q,
                                                         d ** -0.5)
        assert _close(o, want_o, 1e-5) and _close(lse, want_lse, 1e-5)
    with pytest.raises(ValueError, match="each of its parts"):
        kernels.span_attention_split(pool.k[1], pool.v[1], *scales, blocks, bs, 0, 8, q, 0.1, o_parts[:, :1],
                                     lse_parts, work, o, lse)


def test_the_library_splits_spans_on_threads_where_the_compiler_has_openmp(kernels):
    """gcc and clang with libomp build it with OpenMP; the split then runs its parts side by side."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")  # the library's compiler
    probe = subprocess.run([cc, "-fopenmp", "-x", "c", "-", "-o", "/dev/null"], input=b"int main(void){return 0;}",
                           capture_output=True)
    assert kernels.threaded_split == (probe.returncode == 0)
