"""Gated DeltaNet's depthwise causal conv for a step of many sequences at once (varlen), with each
sequence's conv window carried in from the state pool and written back.

Semantics (the reference below, equal to `gated_delta.causal_conv1d_ref` sequence by sequence): the
step's rows are sequences laid out one after another (`spans`: first row, rows, state index, fresh).
Row t of a sequence starting at row s sees inputs t-K+1 .. t; an input before s comes from the
sequence's window (the K-1 inputs before the step, oldest first), or is zero for a fresh sequence.
out = SiLU(sum_j w[c, j] * input_j) per channel, in fp32, rounded to x's dtype. Afterwards each
sequence's window holds its last K-1 inputs (from the step, and the old window where the step has
fewer than K-1 rows).

Kernels: the conv over (row block, channel block) programs, reading windows through each row's span
metadata; then one program per (sequence, channel block) writes the new windows. The second launch
follows the first on the stream, so the conv reads every old window before any is replaced.
"""

from __future__ import annotations

import torch

from strata.kernels import use_pdl, use_triton
from strata.kernels.gated_delta import causal_conv1d_ref
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, tl, triton
from strata.kernels.transfer import to_device  # pinned: a pageable upload would wait for the device


Span = tuple[int, int, int, bool]  # first row, rows, state index, fresh


def causal_conv1d_varlen_ref(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                             spans: list[Span]) -> torch.Tensor:
    """x [T, C]; weight [C, K]; states [S, C, K-1] (updated in place). Returns out [T, C]."""
    out = torch.empty_like(x)
    for r0, n, slot, fresh in spans:
        out[r0 : r0 + n], window = causal_conv1d_ref(x[r0 : r0 + n], weight, None if fresh else states[slot])
        states[slot] = window.to(states.dtype)
    return out


@jit
def _conv_kernel(x_ptr, w_ptr, st_ptr, out_ptr, row_span_ptr, span_start_ptr, span_slot_ptr, span_fresh_ptr,
                 t_rows, c_dim, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < t_rows
    col_ok = cols < c_dim
    span = tl.load(row_span_ptr + rows, mask=row_ok, other=0)
    start = tl.load(span_start_ptr + span, mask=row_ok, other=0)
    slot = tl.load(span_slot_ptr + span, mask=row_ok, other=0)
    fresh = tl.load(span_fresh_ptr + span, mask=row_ok, other=1)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        src = rows - (K - 1) + j  # the input row this tap reads
        in_step = src >= start
        xv = tl.load(x_ptr + src[:, None].to(tl.int64) * c_dim + cols[None, :],
                     mask=(row_ok & in_step)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        # Before the step: the window's entry (K-1) + (src - start), never negative for a tap this near.
        widx = (K - 1) + src - start
        from_window = row_ok & (~in_step) & (fresh == 0)
        sv = tl.load(st_ptr + slot[:, None].to(tl.int64) * (c_dim * (K - 1)) + cols[None, :] * (K - 1) + widx[:, None],
                     mask=from_window[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + cols * K + j, mask=col_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * wv[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * c_dim + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@jit
def _window_kernel(x_ptr, st_ptr, span_start_ptr, span_len_ptr, span_slot_ptr, span_fresh_ptr, c_dim,
                   K: tl.constexpr, W_POW2: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < c_dim
    start = tl.load(span_start_ptr + s)
    n = tl.load(span_len_ptr + s)
    slot = tl.load(span_slot_ptr + s).to(tl.int64)
    fresh = tl.load(span_fresh_ptr + s)
    base = st_ptr + slot * (c_dim * (K - 1)) + cols * (K - 1)
    i = tl.arange(0, W_POW2)  # window entries, padded to a power of two
    i_ok = i < K - 1
    # New entry i is the input at step position n - (K-1) + i: a step row, or old entry i + n.
    pos = n - (K - 1) + i
    in_step = pos >= 0
    xv = tl.load(x_ptr + (start + pos)[None, :].to(tl.int64) * c_dim + cols[:, None],
                 mask=(in_step & i_ok)[None, :] & col_ok[:, None], other=0.0).to(tl.float32)
    from_old = (~in_step) & i_ok & ((i * 0 + fresh) == 0)  # a tensor mask: interpreters reject a scalar bool
    old = tl.load(base[:, None] + (i + n)[None, :], mask=from_old[None, :] & col_ok[:, None], other=0.0).to(tl.float32)
    tl.store(base[:, None] + i[None, :], (xv + old).to(st_ptr.dtype.element_ty), mask=i_ok[None, :] & col_ok[:, None])


def causal_conv1d_varlen_triton(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, spans: list[Span],
                                meta: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels. `meta`: optional int32 [5, >= max(T, N)] device buffer for the span metadata (row ->
    span, then per span: first row, rows, state index, fresh); without it one is made here."""
    t, c = x.shape
    k = weight.shape[1]
    n_spans = len(spans)
    row_span = [i for i, (_, n, _, _) in enumerate(spans) for _ in range(n)]
    cols = [row_span, [s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans], [int(s[3]) for s in spans]]
    width = max(t, n_spans)
    host = torch.zeros(5, width, dtype=torch.int32)
    for i, col in enumerate(cols):
        host[i, : len(col)] = torch.tensor(col, dtype=torch.int32)
    if meta is None:
        meta = to_device(host, x.device, torch.int32)
    else:
        meta[:, :width].copy_(host, non_blocking=True)
    out = torch.empty_like(x)
    pdl = use_pdl(x)
    block_t, block_c = 16, 128
    _conv_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
        x, weight, states, out, meta[0], meta[1], meta[3], meta[4], t, c, K=k, BLOCK_T=block_t, BLOCK_C=block_c,
        USE_PDL=pdl, launch_pdl=pdl)
    _window_kernel[(n_spans, triton.cdiv(c, block_c))](
        x, states, meta[1], meta[2], meta[3], meta[4], c, K=k, W_POW2=triton.next_power_of_2(k - 1), BLOCK_C=block_c,
        USE_PDL=pdl, launch_pdl=pdl)
    return out


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    if use_triton(x) and x.is_contiguous() and weight.is_contiguous() and states.is_contiguous():
        return causal_conv1d_varlen_triton(x, weight, states, spans)
    return causal_conv1d_varlen_ref(x, weight, states, spans)
