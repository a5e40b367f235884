"""Gated DeltaNet's two sequence mixers, as torch references: the causal depthwise conv1d over the
projected q|k|v channels and the gated delta rule. Both carry a per-sequence state across calls, so a
prompt read in chunks gives the same outputs as one read at once.

The gated delta rule, per value head, with S the [Dk, Dv] state, k and q L2-normalised, q scaled
by 1/sqrt(Dk), decay a_t = exp(g_t) (g_t <= 0) and write strength b_t in (0, 1):

    S_t = a_t S_{t-1} + k_t w_t^T,   w_t = b_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

`gated_delta_step_ref` applies it one token at a time (decode: one token per sequence, batched over
sequences). `gated_delta_chunked_ref` applies it to a chunk of C tokens at once with matrix products:
with G_i = g_1 + ... + g_i inside the chunk and S_0 the state before it, unrolling the recurrence gives

    S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i - G_j} k_j w_j^T
    W   = T^{-1} diag(b) (V - diag(e^G) K S_0),   T = I + diag(b) A,  A_jl = e^{G_j - G_l} k_j.k_l (l < j)
    O   = diag(e^G) Q S_0 + (M * Q K^T) W,         M_ij = e^{G_i - G_j} (j <= i)
    S_C = e^{G_C} S_0 + (K * e^{G_C - G})^T W

(T is unit lower triangular: one triangular solve per chunk). Everything runs in fp32, as the
published kernels do; outputs return in the inputs' dtype.

`gated_delta_varlen` runs many sequences' chunks in one call: the reference loops over them; on CUDA
with fla-core installed (kernel choice `linear_attention_kernel`: 'auto' or 'fla') it is one launch of
`fla-core`'s chunked kernel (the maintained Triton implementation, cu_seqlens-batched): on the H200 it
matches the reference (output within 2e-3 in fp32, 7e-3 in bf16) and reads 5.5-5.7x as fast
(`bench/results/read_qwen3-next-*`).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch
import torch.nn.functional as F

from strata.kernels import choices
from strata.kernels.transfer import to_device  # pinned: a pageable upload would wait for the device

CHUNK = 64  # tokens per chunk of the chunked form


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the published kernels' epsilon placement)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's next n inputs through the depthwise causal conv and SiLU.

    x [n, C]; weight [C, K]; state [C, K-1]: the K-1 inputs before x (None: zeros, a fresh sequence).
    Returns (out [n, C] in x's dtype, the new state [C, K-1]: the last K-1 inputs, older ones first)."""
    c, k = weight.shape
    past = x.new_zeros(c, k - 1) if state is None else state.to(x.dtype)
    full = torch.cat([past, x.t()], dim=1)  # [C, K-1+n]
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=c)[0]  # [C, n]
    return F.silu(out.float()).t().to(x.dtype), full[:, -(k - 1):]


def causal_conv1d_step_ref(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence, batched: x [S, C], state [S, C, K-1] → (out [S, C], new state)."""
    full = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [S, C, K]
    out = (full.to(weight.dtype) * weight[None]).sum(-1)
    return F.silu(out).to(x.dtype), full[:, :, 1:]


def _prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k


def gated_delta_step_ref(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [S, H, Dk], v [S, H, Dv], g, beta [S, H], state [S, H, Dk, Dv]
    (fp32). Returns (o [S, H, Dv] in v's dtype, the new state)."""
    q, k = _prepare(q, k)
    s = state.float() * g.float().exp()[..., None, None]
    kv = (s * k[..., None]).sum(-2)  # S^T k: [S, H, Dv]
    w = (v.float() - kv) * beta.float()[..., None]
    s = s + k[..., None] * w[..., None, :]
    return (s * q[..., None]).sum(-2).to(v.dtype), s


def gated_delta_chunked_ref(q, k, v, g, beta, state: torch.Tensor | None, chunk: int = CHUNK
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's n tokens: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H]; state [H, Dk, Dv] fp32
    (None: zeros). Returns (o [n, H, Dv] in v's dtype, the state after the last token)."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    q, k = _prepare(q, k)
    q, k, vf = q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1)  # [H, n, D]
    gf, bf = g.float().t(), beta.float().t()  # [H, n]
    s = torch.zeros(h, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    out = torch.empty(h, n, dv, dtype=torch.float32, device=v.device)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], vf[:, c0:c1], bf[:, c0:c1]
        cum = gf[:, c0:c1].cumsum(-1)  # G [H, C]
        diff = cum[:, :, None] - cum[:, None, :]  # G_i - G_j
        m = c1 - c0
        lower = torch.ones(m, m, dtype=torch.bool, device=v.device).tril()
        # Masked before exp: above the diagonal G_i - G_j > 0 and could overflow.
        decay = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()  # M [H, C, C]
        a = decay * (kc @ kc.transpose(1, 2))
        t = torch.eye(m, device=v.device) + bc[:, :, None] * a.tril(-1)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ s))
        w = torch.linalg.solve_triangular(t, rhs, upper=False, unitriangular=True)  # [H, C, Dv]
        out[:, c0:c1] = cum.exp()[:, :, None] * (qc @ s) + (decay * (qc @ kc.transpose(1, 2))) @ w
        last = cum[:, -1:]
        s = last.exp()[:, :, None] * s + (kc * (last - cum).exp()[:, :, None]).transpose(1, 2) @ w
    return out.transpose(0, 1).to(v.dtype), s


@lru_cache(maxsize=1)
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def use_fla(t: torch.Tensor) -> bool:
    """Whether `gated_delta_varlen` goes through fla-core: on CUDA when the kernel choice
    `linear_attention_kernel` is 'fla', or 'auto' (the default) with fla-core installed."""
    choice = choices.current().linear_attention_kernel
    return t.is_cuda and (choice == "fla" or (choice == "auto" and fla_installed()))


def gated_delta_varlen(q, k, v, g, beta, lengths: list[int], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences laid out one after another: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H] with T =
    sum(lengths); states [N, H, Dk, Dv] fp32, each sequence's state before its tokens. Returns
    (o [T, H, Dv], the states after each sequence's last token [N, H, Dk, Dv] fp32)."""
    if use_fla(v):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        cu_cpu = torch.tensor([0] + lengths).cumsum(0)
        # Its kernels index dense [B, T, H, D] tensors; v and beta arrive as strided views of the projection.
        q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
        # The host copy too, so the kernel's chunk bookkeeping reads no device tensor back.
        o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g.float()[None], beta[None], initial_state=states,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=to_device(cu_cpu, v.device), cu_seqlens_cpu=cu_cpu)
        return o[0], final.float()
    outs, finals, r0 = [], [], 0
    for i, n in enumerate(lengths):
        o, s = gated_delta_chunked_ref(q[r0 : r0 + n], k[r0 : r0 + n], v[r0 : r0 + n], g[r0 : r0 + n],
                                       beta[r0 : r0 + n], states[i])
        outs.append(o)
        finals.append(s)
        r0 += n
    return torch.cat(outs), torch.stack(finals)
