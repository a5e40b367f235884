"""Gated DeltaNet's decode step (one new token per sequence) as two kernels that update the state pool
in place: the causal conv over the projected q|k|v, then the gated delta rule.

Semantics (the references below, which are exactly the model's former decode branch):

- `causal_conv1d_decode`: for each sequence s with state row r = index[s], the window conv_pool[r]
  ([C, K-1], oldest first) is cast to x's dtype, x[s] appended, and out[s] = SiLU(sum_j w[c, j] *
  full[c, j]) in x's dtype; conv_pool[r] becomes the last K-1 entries of that full window.
- `gated_delta_decode`: `gated_delta_step_ref` on state_pool[index], written back. q and k arrive per
  key head ([S, Hk, Dk]); value head h reads key head h // (Hv / Hk), as `repeat_interleave` would lay
  them out, without materialising the copy.
- `gated_delta_decode_with_gating`: the same, from the raw gate projections a, b and the layer's A_log
  and dt_bias: the kernel makes g and beta per (sequence, head) as `delta_gates` makes them in torch
  (which costs 8 small launches a layer in a bf16 model). a and b may also come as the [S, Hk, Hv/Hk]
  views the projection is split into (per key head, its value heads), which spares the two copies that
  flattening them would cost.

Differences from the references, all within fp32 rounding: sums over Dk (and the K conv taps) run in
a different order; the conv's products and sum are fp32 (the reference multiplies and sums in the
weight's dtype, so in a bf16 model it rounds each product and the sum to bf16 before SiLU: the
kernel's bf16 output is the fp32 value rounded once, as the prompt-chunk kernel in causal_conv.py
computes it, within a few bf16 ulps of the reference's); exp is the fast fp32 exp. The gates follow
torch's CUDA kernels operation for operation (libdevice expf and log1pf, an IEEE division, the sigmoid
rounded to b's dtype before use), so on CUDA they should be torch's bits; the interpreter has no
libdevice, and there log1p is rebuilt from log and exp to a few fp32 ulps.

Kernels: the conv runs one program per (sequence, channel block); the delta rule one per (sequence,
value head, Dv block), which loads its [Dk, BLOCK_DV] state tile (all of Dk: both products with the
state reduce over it), decays and updates it in registers, reduces the output from the updated tile
and stores the tile back. A tile is read and written by its own program only, so the pool needs no
copy. Rows are found through `index` on the device (CUDA-graph safe); padding rows of a graph bucket
all name the spare state, whose contents (like their outputs) nobody reads, so their racing updates of
it are harmless, as with the references' `index_copy_` of duplicate rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels import device as devices
from strata.kernels import use_pdl, use_triton
from strata.kernels.device import DeviceSpec
from strata.kernels.gated_delta import causal_conv1d_step_ref, gated_delta_step_ref
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, libdevice, tl, triton


L2_EPS = 1e-6  # `gated_delta.l2_normalize`'s epsilon
CONV_BLOCK_C = 128
# Below this many (sequence, value head) x 32-column programs on the reference's 132 SMs (in proportion
# on other devices: `_block_dv`) the Dv block halves, so a batch-1 step (32 value heads) still spreads
# over the SMs.
MIN_PROGRAMS = 256


# ---- the causal conv ------------------------------------------------------------------------------------

def causal_conv1d_decode_ref(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, index: torch.Tensor,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, C]; weight [C, K]; conv_pool [P, C, K-1] updated in place at rows index [S]. Returns
    out [S, C] in x's dtype."""
    index = index.long()
    y, window = causal_conv1d_step_ref(x, weight, conv_pool.index_select(0, index))
    conv_pool.index_copy_(0, index, window.to(conv_pool.dtype))
    return y if out is None else out.copy_(y)


@jit
def _conv_decode_kernel(x_ptr, x_stride, w_ptr, w_stride, pool_ptr, idx_ptr, out_ptr, out_stride, c_dim,
                        K: tl.constexpr, W_POW2: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < c_dim
    row = tl.load(idx_ptr + s).to(tl.int64)
    i = tl.arange(0, W_POW2)  # window entries, padded to a power of two
    tile_ok = col_ok[:, None] & (i < K - 1)[None, :]
    base = pool_ptr + row * c_dim * (K - 1) + cols[:, None] * (K - 1)
    x_ty = x_ptr.dtype.element_ty
    old = tl.load(base + i[None, :], mask=tile_ok, other=0.0).to(x_ty)  # the reference's state.to(x.dtype)
    xv = tl.load(x_ptr + s.to(tl.int64) * x_stride + cols, mask=col_ok, other=0.0)
    w_row = w_ptr + cols * w_stride
    w_old = tl.load(w_row[:, None] + i[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    w_new = tl.load(w_row + (K - 1), mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.sum(old.to(tl.float32) * w_old, axis=1) + xv.to(tl.float32) * w_new
    y = tl.div_rn(acc, 1.0 + tl.exp(-acc))
    tl.store(out_ptr + s.to(tl.int64) * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)
    # Shift left by one and append x; every entry this program writes it has already read above.
    nxt = tl.load(base + (i + 1)[None, :], mask=col_ok[:, None] & (i + 1 < K - 1)[None, :], other=0.0).to(x_ty)
    window = tl.where((i == K - 2)[None, :], xv[:, None], nxt)
    tl.store(base + i[None, :], window.to(pool_ptr.dtype.element_ty), mask=tile_ok)


def _check_index(index: torch.Tensor, rows: int, device: torch.device) -> None:
    if index.shape != (rows,) or index.dtype not in (torch.int32, torch.int64) or index.device != device:
        raise ValueError(f"index: expected ({rows},) int32/int64 on {device}, got {tuple(index.shape)} "
                         f"{index.dtype} on {index.device}")


def causal_conv1d_decode_triton(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, index: torch.Tensor,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    s, c = x.shape
    k = weight.shape[1]
    if x.stride(1) != 1 or weight.shape[0] != c or weight.stride(1) != 1:
        raise ValueError(f"x [S, C] and weight [C, K] need contiguous rows, got {tuple(x.shape)} strides {x.stride()}, "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    if conv_pool.shape[1:] != (c, k - 1) or not conv_pool.is_contiguous() or k < 2:
        raise ValueError(f"conv_pool: expected contiguous [P, {c}, {k - 1}], got {tuple(conv_pool.shape)}")
    _check_index(index, s, x.device)
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out: expected {tuple(x.shape)} {x.dtype} with contiguous rows")
    if s == 0:
        return out
    on = use_pdl(x)
    _conv_decode_kernel[(s, triton.cdiv(c, CONV_BLOCK_C))](
        x, x.stride(0), weight, weight.stride(0), conv_pool, index, out, out.stride(0), c,
        K=k, W_POW2=triton.next_power_of_2(k - 1), BLOCK_C=CONV_BLOCK_C, USE_PDL=on, launch_pdl=on)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, index: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        return causal_conv1d_decode_triton(x, weight, conv_pool, index, out)
    return causal_conv1d_decode_ref(x, weight, conv_pool, index, out)


# ---- the gated delta rule -------------------------------------------------------------------------------

def gated_delta_decode_ref(q, k, v, g, beta, state_pool: torch.Tensor, index: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q, k [S, Hk, Dk] (key heads); v [S, Hv, Dv]; g, beta [S, Hv]; state_pool [P, Hv, Dk, Dv] fp32
    updated in place at rows index [S]. Returns o [S, Hv, Dv] in v's dtype."""
    ratio = v.shape[1] // q.shape[1]
    index = index.long()
    q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    o, state = gated_delta_step_ref(q, k, v, g, beta, state_pool.index_select(0, index))
    state_pool.index_copy_(0, index, state)
    return o if out is None else out.copy_(o)


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's gates from the raw projections a, b ([N, Hv], or [N, Hk, Hv/Hk] flattened to it)
    and the layer's A_log, dt_bias [Hv]: g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta =
    sigmoid(b) in b's dtype."""
    a, b = a.flatten(1), b.flatten(1)
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gated_delta_decode_with_gating_ref(q, k, v, a, b, a_log, dt_bias, state_pool: torch.Tensor, index: torch.Tensor,
                                       out: torch.Tensor | None = None) -> torch.Tensor:
    """`gated_delta_decode_ref` with g, beta = `delta_gates(a, b, a_log, dt_bias)`."""
    g, beta = delta_gates(a, b, a_log, dt_bias)
    return gated_delta_decode_ref(q, k, v, g, beta, state_pool, index, out)


@jit
def _exp(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@jit
def _softplus(x, USE_LIBDEVICE: tl.constexpr):
    """F.softplus with its defaults (beta 1, threshold 20): x above 20, else log1p(exp(x))."""
    e = _exp(tl.minimum(x, 20.0), USE_LIBDEVICE)  # clamped: exp stays finite where x is taken anyway
    if USE_LIBDEVICE:
        log1p = libdevice.log1p(e)
    else:  # log(1 + e) corrected by e / ((1 + e) - 1), the rounding of 1 + e (Goldberg's log1p)
        w = 1.0 + e
        exact = w == 1.0
        log1p = tl.where(exact, e, tl.log(w) * tl.div_rn(e, tl.where(exact, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@jit
def _l2_normalized(ptr, offs, mask, eps):
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x * tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) + eps))


@jit
def _gated_delta_decode_kernel(q_ptr, q_ss, q_sh, k_ptr, k_ss, k_sh, v_ptr, v_ss, v_sh,
                               g_ptr, g_ss, g_sk, g_sr, b_ptr, b_ss, b_sk, b_sr, alog_ptr, dtb_ptr,
                               st_ptr, idx_ptr, o_ptr, o_ss, o_sh, scale, eps,
                               HV: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                               DK_POW2: tl.constexpr, BLOCK_DV: tl.constexpr, RAW_GATES: tl.constexpr,
                               USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    """g_ptr, b_ptr: g and beta, or with RAW_GATES the projections a and b that make them with A_log
    and dt_bias. Value head h sits at (h // RATIO) * _sk + (h % RATIO) * _sr in them."""
    pdl_prologue(USE_PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // RATIO
    g_in = tl.load(g_ptr + s * g_ss + hk * g_sk + (h % RATIO) * g_sr).to(tl.float32)
    b_in = tl.load(b_ptr + s * b_ss + hk * b_sk + (h % RATIO) * b_sr)
    if RAW_GATES:
        g = -_exp(tl.load(alog_ptr + h).to(tl.float32), USE_LIBDEVICE) * _softplus(
            g_in + tl.load(dtb_ptr + h).to(tl.float32), USE_LIBDEVICE)
        # torch's sigmoid on b's dtype: computed in fp32, then rounded to that dtype
        sig = tl.div_rn(1.0, 1.0 + _exp(-b_in.to(tl.float32), USE_LIBDEVICE))
        beta = sig.to(b_ptr.dtype.element_ty).to(tl.float32)
    else:
        g = g_in
        beta = b_in.to(tl.float32)
    cols = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    col_ok = cols < DV
    dk = tl.arange(0, DK_POW2)
    dk_ok = dk < DK
    q = _l2_normalized(q_ptr + s * q_ss + hk * q_sh, dk, dk_ok, eps) * scale
    k = _l2_normalized(k_ptr + s * k_ss + hk * k_sh, dk, dk_ok, eps)
    decay = tl.exp(g)
    v = tl.load(v_ptr + s * v_ss + h * v_sh + cols, mask=col_ok, other=0.0).to(tl.float32)
    row = tl.load(idx_ptr + s).to(tl.int64)
    tile = st_ptr + (row * HV + h) * (DK * DV) + dk[:, None] * DV + cols[None, :]
    tile_ok = dk_ok[:, None] & col_ok[None, :]
    state = tl.load(tile, mask=tile_ok, other=0.0) * decay
    w = (v - tl.sum(state * k[:, None], axis=0)) * beta  # (v - S^T k) * beta: [BLOCK_DV]
    state = state + k[:, None] * w[None, :]
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(tile, state, mask=tile_ok)
    tl.store(o_ptr + s * o_ss + h * o_sh + cols, o.to(o_ptr.dtype.element_ty), mask=col_ok)


def _block_dv(seqs: int, hv: int, dv: int, spec: DeviceSpec | None = None) -> int:
    sms = (spec or devices.current()).sm_count
    block = min(32, triton.next_power_of_2(dv))
    if block > 16 and seqs * hv * triton.cdiv(dv, block) < -(-MIN_PROGRAMS * sms // devices.REFERENCE.sm_count):
        block = 16
    return block


def _head_strides(t: torch.Tensor, name: str, s: int, hk: int, ratio: int, grouped: bool) -> tuple[int, int, int]:
    """(sequence, key head, value head within it) strides of a per-(sequence, value head) input: [S, Hv],
    or with `grouped` also [S, Hk, Hv/Hk]."""
    if t.shape == (s, hk * ratio):
        return t.stride(0), ratio * t.stride(1), t.stride(1)
    if grouped and t.shape == (s, hk, ratio):
        return t.stride()
    want = f"({s}, {hk * ratio})" + (f" or ({s}, {hk}, {ratio})" if grouped else "")
    raise ValueError(f"{name}: expected {want}, got {tuple(t.shape)}")


def _launch_delta(q, k, v, g, beta, gates: tuple[torch.Tensor, torch.Tensor] | None, state_pool: torch.Tensor,
                  index: torch.Tensor, out: torch.Tensor | None, block_dv: int | None) -> torch.Tensor:
    """g, beta as they are, or with `gates` = (A_log, dt_bias) the raw a, b that make them."""
    s, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != s or hk == 0 or hv % hk:
        raise ValueError(f"q, k [S, Hk, Dk] and v [S, Hv, Dv] with Hv a multiple of Hk, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k, v: the head dim must be contiguous")
    raw = gates is not None
    names = ("a", "b") if raw else ("g", "beta")
    g_strides = _head_strides(g, names[0], s, hk, hv // hk, grouped=raw)
    b_strides = _head_strides(beta, names[1], s, hk, hv // hk, grouped=raw)
    a_log, dt_bias = gates if raw else (g, g)  # unread without RAW_GATES
    if raw and any(t.shape != (hv,) or t.stride(0) != 1 for t in gates):
        raise ValueError(f"A_log, dt_bias: expected contiguous ({hv},), got {tuple(a_log.shape)}, "
                         f"{tuple(dt_bias.shape)}")
    if (state_pool.shape[1:] != (hv, dk, dv) or state_pool.dtype != torch.float32
            or not state_pool.is_contiguous()):
        raise ValueError(f"state_pool: expected contiguous fp32 [P, {hv}, {dk}, {dv}], got "
                         f"{tuple(state_pool.shape)} {state_pool.dtype}")
    _check_index(index, s, v.device)
    if out is None:
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
    elif out.shape != v.shape or out.dtype != v.dtype or out.stride(2) != 1:
        raise ValueError(f"out: expected {tuple(v.shape)} {v.dtype} with a contiguous head dim")
    if s == 0:
        return out
    block = block_dv or _block_dv(s, hv, dv, devices.current(v))
    on = use_pdl(v)
    _gated_delta_decode_kernel[(s, hv, triton.cdiv(dv, block))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        g, *g_strides, beta, *b_strides, a_log, dt_bias, state_pool, index,
        out, out.stride(0), out.stride(1), dk ** -0.5, L2_EPS,
        HV=hv, RATIO=hv // hk, DK=dk, DV=dv, DK_POW2=triton.next_power_of_2(dk), BLOCK_DV=block,
        RAW_GATES=raw, USE_LIBDEVICE=v.is_cuda, USE_PDL=on, launch_pdl=on, num_warps=4)
    return out


def gated_delta_decode_triton(q, k, v, g, beta, state_pool: torch.Tensor, index: torch.Tensor,
                              out: torch.Tensor | None = None, block_dv: int | None = None) -> torch.Tensor:
    """The kernel; `block_dv` (a power of two) overrides the Dv block the launch picks."""
    return _launch_delta(q, k, v, g, beta, None, state_pool, index, out, block_dv)


def gated_delta_decode_with_gating_triton(q, k, v, a, b, a_log, dt_bias, state_pool: torch.Tensor,
                                          index: torch.Tensor, out: torch.Tensor | None = None,
                                          block_dv: int | None = None) -> torch.Tensor:
    """The kernel, making g and beta from a, b, A_log, dt_bias itself."""
    return _launch_delta(q, k, v, a, b, (a_log, dt_bias), state_pool, index, out, block_dv)


def gated_delta_decode(q, k, v, g, beta, state_pool: torch.Tensor, index: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(v):
        return gated_delta_decode_triton(q, k, v, g, beta, state_pool, index, out)
    return gated_delta_decode_ref(q, k, v, g, beta, state_pool, index, out)


def gated_delta_decode_with_gating(q, k, v, a, b, a_log, dt_bias, state_pool: torch.Tensor, index: torch.Tensor,
                                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q, k [S, Hk, Dk]; v [S, Hv, Dv]; a, b [S, Hv] or [S, Hk, Hv/Hk] in the model's dtype; A_log,
    dt_bias [Hv]. `gated_delta_decode` with g, beta = `delta_gates(a, b, A_log, dt_bias)`."""
    if use_triton(v):
        return gated_delta_decode_with_gating_triton(q, k, v, a, b, a_log, dt_bias, state_pool, index, out)
    return gated_delta_decode_with_gating_ref(q, k, v, a, b, a_log, dt_bias, state_pool, index, out)
