"""The decoder layer's small kernels (norm, q/k norm + RoPE, K/V store, SiLU-mul) against their torch
references, and the references against the model code they replace.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET)
at small shapes; with CUDA the same tests run compiled on the GPU, and the `gpu` tests add real sizes
and CUDA-graph capture. Outputs are poisoned with NaN first and compared whole.

Tolerances, and why:
- fp32 norms and SiLU: ≤ 1e-6 relative (max error / max value). The kernel's sum of squares runs in
  another order than torch's; SiLU's exp on the CPU is numpy's in the interpreter, not torch's.
- bf16 norms: ≤ 1e-2 relative with ≤ 1% of elements off. Only the fp32 sum order differs, so a value
  moves by one bf16 ulp in the rare case where that flips its rounding; a wrong rounding mode would
  move about half of them. The residual sum itself is bit-exact.
- SiLU-mul on CUDA: bit-exact (libdevice expf and an IEEE division, as torch's CUDA kernel).
- q/k norm + RoPE: the kernel rotates in fp32 with fp32 cos/sin and rounds once; the reference rounds
  cos, sin, both products and the sum to the dtype. In bf16 that puts the reference up to ~0.9e-2
  (of the largest value) from the exact result and the kernel ~0.5e-2, so they may differ by 2e-2;
  the kernel must also be no further from an fp64 evaluation than the reference is. fp32: ≤ 1e-5.
- int8 K/V: bit-exact values and scales, exact rounding ties included.
- Batch invariance: a row alone and the same row in a batch of 7 agree bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from strata.config import RopeConfig
from strata.kernels import activation, kv_store, norm, rope
from strata.kvcache.pool import DensePool, Int8Pool, quantize_int8
from strata.models.layers import RMSNorm, Rotary, apply_rotary, rope_inv_freq

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEV)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _assert_close(out: torch.Tensor, ref: torch.Tensor, fp32_tol: float, bf16_tol: float = 1e-2,
                  bf16_max_mismatch: float | None = 0.01) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite values (unwritten NaN poison?)"
    tol = fp32_tol if out.dtype == torch.float32 else bf16_tol
    err = _rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3g} > {tol}"
    if out.dtype == torch.bfloat16 and bf16_max_mismatch is not None:
        mismatch = (out != ref).float().mean().item()
        assert mismatch <= bf16_max_mismatch, f"{mismatch:.2%} of bf16 values differ"


DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------------------------- norms

def _norm_inputs(n, h, dtype, seed=0):
    x = _randn(n, h, dtype=dtype, seed=seed, scale=3.0)
    w = (1 + 0.5 * torch.randn(h, generator=_gen(seed + 1))).to(dtype).to(DEV)
    return x, w


def test_rms_norm_ref_is_the_module():
    for dtype in DTYPES:
        x, w = _norm_inputs(5, 48, dtype)
        m = RMSNorm(48, EPS).to(dtype)
        m.weight.data.copy_(w.cpu())
        assert torch.equal(norm.rms_norm_ref(x.cpu(), w.cpu(), EPS), m(x.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h,strided", [(1, 32, False), (3, 48, True), (7, 80, False), (4, 96, True)])
def test_rms_norm(dtype, n, h, strided):
    x, w = _norm_inputs(n, h, dtype)
    if strided:  # rows of a wider buffer, written into rows of another
        x = torch.cat([x, _randn(n, 16, dtype=dtype, seed=9)], dim=1)[:, :h]
        out = torch.full((n, h + 8), float("nan"), dtype=dtype, device=DEV)[:, :h]
    else:
        out = torch.full((n, h), float("nan"), dtype=dtype, device=DEV)
    got = norm.rms_norm_triton(x, w, EPS, out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_close(out, norm.rms_norm_ref(x, w, EPS), fp32_tol=1e-6)
    _assert_close(norm.rms_norm_triton(x, w, EPS), norm.rms_norm_ref(x, w, EPS), fp32_tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h", [(1, 32), (5, 48), (7, 96)])
def test_fused_add_rms_norm(dtype, n, h):
    x, w = _norm_inputs(n, h, dtype)
    res = _randn(n, h, dtype=dtype, seed=5, scale=2.0)
    ref_res = res.clone()
    ref_out, _ = norm.fused_add_rms_norm_ref(x, ref_res, w, EPS)
    out = torch.full((n, h), float("nan"), dtype=dtype, device=DEV)
    got, new_res = norm.fused_add_rms_norm_triton(x, res, w, EPS, out=out)
    assert new_res is res and got.data_ptr() == out.data_ptr()
    assert torch.equal(res, ref_res)  # the sum, rounded once, written in place
    _assert_close(out, ref_out, fp32_tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [80, 96])
def test_norms_over_several_blocks(monkeypatch, dtype, h):
    """Rows longer than the widest block take the two-pass loop; shrink the block to reach it here."""
    monkeypatch.setattr(norm, "MAX_ROW_BLOCK", 32)
    x, w = _norm_inputs(3, h, dtype)
    _assert_close(norm.rms_norm_triton(x, w, EPS), norm.rms_norm_ref(x, w, EPS), fp32_tol=1e-6)
    res = _randn(3, h, dtype=dtype, seed=5)
    ref_res = res.clone()
    ref_out, _ = norm.fused_add_rms_norm_ref(x, ref_res, w, EPS)
    got, _ = norm.fused_add_rms_norm_triton(x, res, w, EPS)
    assert torch.equal(res, ref_res)
    _assert_close(got, ref_out, fp32_tol=1e-6)


def test_rms_norm_fp32_weight_on_bf16_rows():
    x, _ = _norm_inputs(3, 48, torch.bfloat16)
    w = _randn(48, seed=3)
    _assert_close(norm.rms_norm_triton(x, w, EPS), norm.rms_norm_ref(x, w, EPS), fp32_tol=0)


# ---------------------------------------------------------------------------------------- q/k norm + RoPE

HQ, HKV = 4, 2
YARN = RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position=256)


def _rope_inputs(n, head_dim, rotary_dim, dtype, norm_on, yarn, pos_dtype=torch.int64, seed=0, w_dtype=None, hq=HQ,
                 hkv=HKV):
    qkv = _randn(n, (hq + 2 * hkv) * head_dim, dtype=dtype, seed=seed, scale=2.0)
    positions = torch.randint(0, 5000, (n,), generator=_gen(seed + 1)).to(pos_dtype).to(DEV)
    inv_freq, scale = rope_inv_freq(YARN if yarn else RopeConfig(), rotary_dim)
    if yarn:
        assert scale != 1.0
    qw = kw = None
    if norm_on:
        w_dtype = w_dtype or dtype
        qw = (1 + 0.3 * torch.randn(head_dim, generator=_gen(seed + 2))).to(w_dtype).to(DEV)
        kw = (1 + 0.3 * torch.randn(head_dim, generator=_gen(seed + 3))).to(w_dtype).to(DEV)
    return qkv, positions, inv_freq.to(DEV), scale, qw, kw


def _rope_args(qkv, positions, inv_freq, scale, qw, kw, head_dim, rotary_dim, hq=HQ, hkv=HKV):
    return (qkv, positions, inv_freq, scale, qw, kw, EPS, hq, hkv, head_dim, rotary_dim)


def _qk_norm_rope_fp64(qkv, positions, inv_freq, scale, qw, kw, head_dim, rotary_dim, hq, hkv):
    """q and k heads [N, hq + hkv, D] evaluated in fp64 from the same inputs (the angle in fp32, as defined)."""
    heads = qkv.double().view(qkv.shape[0], -1, head_dim)[:, :hq + hkv].clone()
    if qw is not None:
        w = torch.cat([qw.double().expand(hq, head_dim), kw.double().expand(hkv, head_dim)])
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + EPS) * w
    angle = (positions.float()[:, None] * inv_freq[None, :]).double()[:, None, :]
    cos, sin = angle.cos() * scale, angle.sin() * scale
    half = rotary_dim // 2
    x1, x2 = heads[..., :half].clone(), heads[..., half:rotary_dim].clone()
    heads[..., :half], heads[..., half:rotary_dim] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return heads


def _check_qk_norm_rope(inputs, head_dim, rotary_dim, hq=HQ, hkv=HKV):
    """Runs kernel and reference on copies of inputs[0]; checks v untouched, the pass-through dims and the
    tolerances in the module docstring."""
    qkv, n = inputs[0], inputs[0].shape[0]
    ref_qkv, got_qkv = qkv.clone(), qkv.clone()
    rope.qk_norm_rope_ref(*_rope_args(ref_qkv, *inputs[1:], head_dim, rotary_dim, hq, hkv))
    q, k, v = rope.qk_norm_rope_triton(*_rope_args(got_qkv, *inputs[1:], head_dim, rotary_dim, hq, hkv))
    assert q.shape == (n, hq, head_dim) and k.shape == (n, hkv, head_dim) and v.shape == (n, hkv, head_dim)
    assert q.data_ptr() == got_qkv.data_ptr()
    assert v.data_ptr() == got_qkv.data_ptr() + (hq + hkv) * head_dim * qkv.itemsize
    got, ref, old = (t.view(n, hq + 2 * hkv, head_dim) for t in (got_qkv, ref_qkv, qkv))
    assert torch.equal(got[:, hq + hkv:], old[:, hq + hkv:])  # v untouched
    if inputs[4] is None:  # no norm: dims past rotary_dim pass through
        assert torch.equal(got[:, :, rotary_dim:], old[:, :, rotary_dim:])
    got, ref = got[:, :hq + hkv], ref[:, :hq + hkv]
    _assert_close(got, ref, fp32_tol=1e-5, bf16_tol=2e-2, bf16_max_mismatch=None)
    if qkv.dtype == torch.bfloat16:
        exact = _qk_norm_rope_fp64(*inputs, head_dim, rotary_dim, hq, hkv)
        assert _rel_err(got, exact) <= _rel_err(ref, exact) + 1e-3


@pytest.mark.parametrize("norm_on", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_ref_is_the_model_code(norm_on, dtype):
    """The reference equals layers.py's torch path: RMSNorm per head, Rotary.cos_sin, apply_rotary."""
    d, rd, n = 32, 16, 5
    qkv, positions, inv_freq, scale, qw, kw = _rope_inputs(n, d, rd, dtype, norm_on, yarn=True)
    qkv, positions, inv_freq = qkv.cpu(), positions.cpu(), inv_freq.cpu()
    qw, kw = (qw.cpu(), kw.cpu()) if norm_on else (None, None)
    heads = qkv.view(n, HQ + 2 * HKV, d).clone()
    q, k, v = heads[:, :HQ], heads[:, HQ:HQ + HKV], heads[:, HQ + HKV:]
    if norm_on:
        qn, kn = RMSNorm(d, EPS).to(dtype), RMSNorm(d, EPS).to(dtype)
        qn.weight.data.copy_(qw)
        kn.weight.data.copy_(kw)
        q, k = qn(q), kn(k)
    cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=inv_freq, scale=scale), positions, dtype)
    want_q, want_k = apply_rotary(q, cos, sin).to(dtype), apply_rotary(k, cos, sin).to(dtype)
    got_q, got_k, got_v = rope.qk_norm_rope_ref(*_rope_args(qkv, positions, inv_freq, scale, qw, kw, d, rd))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_on", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim,yarn,pos_dtype", [
    (16, 16, False, torch.int64), (32, 32, True, torch.int32), (32, 16, False, torch.int32), (16, 8, True, torch.int64),
    (40, 24, True, torch.int64),  # halves and pass-through of 12 and 16: masked blocks
])
def test_qk_norm_rope(dtype, norm_on, head_dim, rotary_dim, yarn, pos_dtype):
    _check_qk_norm_rope(_rope_inputs(6, head_dim, rotary_dim, dtype, norm_on, yarn, pos_dtype), head_dim, rotary_dim)


def test_qk_norm_rope_fp32_weights_on_bf16():
    """Under autocast the norm weights stay fp32: the reference keeps normed q/k in fp32 until the end."""
    _check_qk_norm_rope(_rope_inputs(4, 32, 16, torch.bfloat16, True, True, w_dtype=torch.float32), 32, 16)


# ---------------------------------------------------------------------------------------------- K/V store

def _kv_inputs(n, hkv, d, dtype, seed=0):
    """k and v as strided views of a q|k|v row, as the projection leaves them."""
    hq = 2 * hkv
    qkv = _randn(n, (hq + 2 * hkv) * d, dtype=dtype, seed=seed, scale=2.0).view(n, hq + 2 * hkv, d)
    slots = torch.randperm(3 * n + 4, generator=_gen(seed + 1))[:n].to(DEV)
    return qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], slots


def _check_kv_store(k, v, slots, num_slots, cache_dtype, quantized):
    hkv, d = k.shape[1:]
    if quantized:
        caches = [torch.full((num_slots, hkv, d), -128, dtype=torch.int8, device=DEV) for _ in range(2)]
        scales = [torch.full((num_slots, hkv), float("nan"), device=DEV) for _ in range(2)]
    else:
        caches = [torch.full((num_slots, hkv, d), float("nan"), dtype=cache_dtype, device=DEV) for _ in range(2)]
        scales = [None, None]
    ref_caches = [c.clone() for c in caches]
    ref_scales = [s if s is None else s.clone() for s in scales]
    kv_store.store_kv_ref(k, v, *ref_caches, slots, *ref_scales)
    kv_store.store_kv_triton(k, v, *caches, slots, *scales)
    for got, want in zip(caches + scales, ref_caches + ref_scales):
        if got is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    written = torch.zeros(num_slots, dtype=torch.bool, device=DEV)
    written[slots] = True
    if quantized:  # values clamp to ±127, so the -128 poison is gone exactly where a row was written
        assert ((caches[0] != -128).all(dim=(1, 2)) == written).all()
    else:
        assert (caches[0].isfinite().all(dim=(1, 2)) == written).all()


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                   (torch.float32, torch.float32)])
def test_store_kv_dense(src_dtype, cache_dtype):
    k, v, slots = _kv_inputs(5, 2, 32, src_dtype)
    _check_kv_store(k, v, slots, 20, cache_dtype, quantized=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hkv,d", [(1, 2, 16), (6, 3, 32)])
def test_store_kv_int8(dtype, n, hkv, d):
    k, v, slots = _kv_inputs(n, hkv, d, dtype)
    _check_kv_store(k, v, slots, 3 * n + 4, None, quantized=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_int8_ties_and_zeros(dtype):
    """amax = 127 * 2^j gives the scale 2^j exactly on every device, so x = (m + 0.5) * 2^j are exact
    ties: round half to even, as torch.round."""
    n, hkv, d = 3, 2, 16
    k, v, slots = _kv_inputs(n, hkv, d, dtype, seed=4)
    ties = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 4.5, -3.5, 0.25, 0, 1, -1.0])
    k[0, 0] = ties.to(dtype)
    k[1, 1] = (ties * 4).to(dtype)
    k[2, 0] = (ties / 8).to(dtype)
    v[0, 1] = 0  # an all-zero head: scale clamped to 1e-8
    assert torch.equal(quantize_int8(k[:1, :1].float())[0][0, 0, :8].cpu(),
                       torch.tensor([127, 0, 2, 2, 0, -2, -2, 126], dtype=torch.int8))
    _check_kv_store(k, v, slots, 3 * n + 4, None, quantized=True)


def test_store_kv_ref_is_the_pool_write():
    k, v, slots = (t.cpu() for t in _kv_inputs(4, 2, 16, torch.bfloat16))
    dense, int8 = DensePool(1, 4, 4, 2, 16, "cpu", torch.bfloat16), Int8Pool(1, 4, 4, 2, 16, "cpu")
    dense.write(0, slots, k, v)
    int8.write(0, slots, k, v)
    kc, vc = torch.zeros_like(dense.k[0]), torch.zeros_like(dense.v[0])
    kv_store.store_kv_ref(k, v, kc, vc, slots)
    assert torch.equal(kc, dense.k[0]) and torch.equal(vc, dense.v[0])
    kq, vq = torch.zeros_like(int8.k[0]), torch.zeros_like(int8.v[0])
    ks, vs = torch.zeros_like(int8.k_scale[0]), torch.zeros_like(int8.v_scale[0])
    kv_store.store_kv_ref(k, v, kq, vq, slots, ks, vs)
    assert all(torch.equal(a, b) for a, b in zip((kq, vq, ks, vs), (int8.k[0], int8.v[0], int8.k_scale[0],
                                                                     int8.v_scale[0])))


# ---------------------------------------------------------------------------------------------- SiLU-mul

@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # numpy's exp(-g) for very negative g
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 32), (4, 48), (7, 80)])
def test_silu_mul(dtype, n, inter):
    x = _randn(n, 2 * inter, dtype=dtype, seed=inter, scale=4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0], dtype=dtype)  # exp overflow and the saturated ends
    out = torch.full((n, inter), float("nan"), dtype=dtype, device=DEV)
    assert activation.silu_mul_triton(x, out=out).data_ptr() == out.data_ptr()
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    if CUDA:
        assert torch.equal(out, ref)
    else:
        _assert_close(out, ref, fp32_tol=1e-6)
    wide = torch.cat([x, x[:, :16]], dim=1)[:, :2 * inter]  # rows of a wider buffer
    torch.testing.assert_close(activation.silu_mul_triton(wide), out, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- batches

@pytest.mark.parametrize("dtype", DTYPES)
def test_row_alone_equals_row_in_batch(dtype):
    n, row = 7, 4
    x, w = _norm_inputs(n, 80, dtype)
    assert torch.equal(norm.rms_norm_triton(x[row:row + 1], w, EPS)[0], norm.rms_norm_triton(x, w, EPS)[row])
    res = _randn(n, 80, dtype=dtype, seed=8)
    one_res = res[row:row + 1].clone()
    alone, _ = norm.fused_add_rms_norm_triton(x[row:row + 1], one_res, w, EPS)
    batch, _ = norm.fused_add_rms_norm_triton(x, res, w, EPS)
    assert torch.equal(alone[0], batch[row]) and torch.equal(one_res[0], res[row])

    qkv, positions, inv_freq, scale, qw, kw = _rope_inputs(n, 32, 16, dtype, True, True)
    one = qkv[row:row + 1].clone()
    rope.qk_norm_rope_triton(*_rope_args(one, positions[row:row + 1], inv_freq, scale, qw, kw, 32, 16))
    rope.qk_norm_rope_triton(*_rope_args(qkv, positions, inv_freq, scale, qw, kw, 32, 16))
    assert torch.equal(one[0], qkv[row])

    g = _randn(n, 96, dtype=dtype, seed=6)
    assert torch.equal(activation.silu_mul_triton(g[row:row + 1])[0], activation.silu_mul_triton(g)[row])

    k, v, slots = _kv_inputs(n, 2, 16, dtype)
    caches = [torch.zeros(32, 2, 16, dtype=torch.int8, device=DEV) for _ in range(4)]
    scales = [torch.zeros(32, 2, device=DEV) for _ in range(4)]
    kv_store.store_kv_triton(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    kv_store.store_kv_triton(k[row:row + 1], v[row:row + 1], caches[2], caches[3], slots[row:row + 1], scales[2],
                             scales[3])
    s = slots[row]
    assert torch.equal(caches[0][s], caches[2][s]) and torch.equal(scales[1][s], scales[3][s])


def test_dispatch_runs_the_reference_off_cuda():
    x, w = (t.cpu() for t in _norm_inputs(3, 32, torch.float32))
    assert torch.equal(norm.rms_norm(x, w, EPS), norm.rms_norm_ref(x, w, EPS))
    res = torch.ones_like(x)
    out, new_res = norm.fused_add_rms_norm(x, res, w, EPS)
    assert new_res is res and torch.equal(res, x + 1)  # in place on every path
    assert torch.equal(activation.silu_mul(x), activation.silu_mul_ref(x))
    with pytest.raises(ValueError):
        kv_store.store_kv_triton(x.view(3, 2, 16), x.view(3, 2, 16), torch.zeros(8, 2, 16, dtype=torch.int8),
                                 torch.zeros(8, 2, 16, dtype=torch.int8), torch.arange(3))


# ---------------------------------------------------------------------------------------------- GPU sizes

H, I, D, GPU_HQ, GPU_HKV = 4096, 12288, 128, 32, 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 512])
@pytest.mark.parametrize("h", [H, 16384])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_norms(dtype, n, h):
    x, w = _norm_inputs(n, h, dtype, seed=n)
    out = torch.full_like(x, float("nan"))
    norm.rms_norm_triton(x, w, EPS, out=out)
    _assert_close(out, norm.rms_norm_ref(x, w, EPS), fp32_tol=1e-6)
    res = _randn(n, h, dtype=dtype, seed=n + 1, scale=4.0)
    ref_res = res.clone()
    ref_out, _ = norm.fused_add_rms_norm_ref(x, ref_res, w, EPS)
    out.fill_(float("nan"))
    norm.fused_add_rms_norm_triton(x, res, w, EPS, out=out)
    assert torch.equal(res, ref_res)
    _assert_close(out, ref_out, fp32_tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 512])
@pytest.mark.parametrize("rotary_dim,norm_on,yarn", [(128, True, False), (64, True, True), (128, False, True)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_qk_norm_rope(dtype, n, rotary_dim, norm_on, yarn):
    qkv = _randn(n, (GPU_HQ + 2 * GPU_HKV) * D, dtype=dtype, seed=n, scale=2.0)
    positions = torch.randint(0, 131072, (n,), generator=_gen(n)).to(DEV)
    inv_freq, scale = rope_inv_freq(YARN if yarn else RopeConfig(theta=1e6), rotary_dim)
    w = [(1 + 0.3 * torch.randn(D, generator=_gen(s))).to(dtype).to(DEV) if norm_on else None for s in (1, 2)]
    _check_qk_norm_rope((qkv, positions, inv_freq.to(DEV), scale, *w), D, rotary_dim, GPU_HQ, GPU_HKV)


@pytest.mark.parametrize("n", [1, 8, 512])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_store_kv(n, kind):
    k, v, _ = _kv_inputs(n, GPU_HKV, D, torch.bfloat16, seed=n)
    slots = torch.randperm(4096, generator=_gen(n))[:n].to(DEV)
    _check_kv_store(k, v, slots, 4096, torch.bfloat16, quantized=kind == "int8")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 8, 512])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_silu_mul(dtype, n):
    x = _randn(n, 2 * I, dtype=dtype, seed=n, scale=4.0)
    out = torch.full((n, I), float("nan"), dtype=dtype, device=DEV)
    activation.silu_mul_triton(x, out=out)
    assert torch.equal(out, F.silu(x[:, :I]) * x[:, I:])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_ops_capture_in_a_graph_without_syncs():
    n, dtype = 8, torch.bfloat16
    x, w = _norm_inputs(n, H, dtype)
    res = _randn(n, H, dtype=dtype, seed=3)
    qkv = _randn(n, (GPU_HQ + 2 * GPU_HKV) * D, dtype=dtype, seed=4)
    positions = torch.arange(100, 100 + n, device=DEV)
    inv_freq, scale = rope_inv_freq(YARN, D)
    inv_freq = inv_freq.to(DEV)
    gate_up = _randn(n, 2 * I, dtype=dtype, seed=5)
    slots = torch.arange(n, device=DEV) * 3
    kc, vc = (torch.zeros(64, GPU_HKV, D, dtype=torch.int8, device=DEV) for _ in range(2))
    ks, vs = (torch.zeros(64, GPU_HKV, device=DEV) for _ in range(2))
    outs = [torch.empty_like(x), torch.empty_like(x), torch.empty(n, I, dtype=dtype, device=DEV)]

    def step():
        norm.rms_norm_triton(x, w, EPS, out=outs[0])
        norm.fused_add_rms_norm_triton(x, res, w, EPS, out=outs[1])
        _, k, v = rope.qk_norm_rope_triton(qkv, positions, inv_freq, scale, w[:D], w[D:2 * D], EPS, GPU_HQ, GPU_HKV,
                                           D, D)
        kv_store.store_kv_triton(k, v, kc, vc, slots, ks, vs)
        activation.silu_mul_triton(gate_up, out=outs[2])

    state = [t.clone() for t in (res, qkv)]
    step()  # compile outside the capture
    eager = [t.clone() for t in outs + [res, qkv, kc, vc, ks, vs]]
    res.copy_(state[0])
    qkv.copy_(state[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for t in outs + [kc, vc, ks, vs]:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs + [res, qkv, kc, vc, ks, vs], eager):
        assert torch.equal(got, want)
