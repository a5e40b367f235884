"""Grammar token masks applied to logits in place: disallowed tokens get -inf.

`bitmask` [R, W] int32 holds one row per logits row, bit `t % 32` of word `t // 32` set when token `t`
is allowed (the layout grammar engines fill, `strata.grammar`); W ≥ ceil(V / 32), extra words are
ignored. A row whose words are all ones (-1) is left untouched, so rows without a grammar cost one read
of their mask and no write. `active` optionally selects rows: a device tensor [R] (nonzero = apply)
keeps the launch graph-safe, the grid coming from the shapes alone; an int applies the first `active`
rows (eager use: the int is part of the launch).

The kernel never reads the logits: it stores -inf only where a bit is clear (a masked store), so its
traffic is the mask plus the disallowed entries.
"""

from __future__ import annotations

import torch

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, tl, triton


BLOCK_TOKENS = 1024  # 32 mask words per program


def _check(logits: torch.Tensor, bitmask: torch.Tensor, active: torch.Tensor | int | None) -> int:
    """The number of rows to mask."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [R, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits: expected float32, bfloat16 or float16, got {logits.dtype}")
    r, v = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1 \
            or bitmask.shape[0] < r or bitmask.shape[1] * 32 < v:
        raise ValueError(f"bitmask: expected int32 [>={r}, >={(v + 31) // 32}] with contiguous rows, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)} strides {bitmask.stride()}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")
    if isinstance(active, torch.Tensor):
        if active.shape != (r,) or active.device != logits.device:
            raise ValueError(f"active: expected [{r}] on {logits.device}, got {tuple(active.shape)} on {active.device}")
        return r
    if active is None:
        return r
    if not 0 <= active <= r:
        raise ValueError(f"active: a row count in [0, {r}], got {active}")
    return active


def apply_token_mask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                         active: torch.Tensor | int | None = None) -> torch.Tensor:
    rows = _check(logits, bitmask, active)
    v = logits.shape[1]
    tokens = torch.arange(v, device=logits.device)
    words = bitmask[:rows, tokens >> 5].long()
    disallowed = ((words >> (tokens & 31)) & 1) == 0
    if isinstance(active, torch.Tensor):
        disallowed &= (active != 0)[:, None]
    logits[:rows].masked_fill_(disallowed, float("-inf"))
    return logits


@jit
def _token_mask_kernel(logits_ptr, logits_stride, mask_ptr, mask_stride, active_ptr, vocab,
                       HAS_ACTIVE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    word_ids = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    words = tl.load(mask_ptr + row * mask_stride + word_ids, mask=word_ids * 32 < vocab, other=-1)
    if HAS_ACTIVE:  # an inactive row reads as all allowed
        words = tl.where(tl.load(active_ptr + row) != 0, words, -1)
    if tl.sum((words != -1).to(tl.int32), axis=0) != 0:  # some token of the block is disallowed
        bits = tl.arange(0, 32)
        allowed = (words[:, None] >> bits[None, :]) & 1
        tokens = word_ids[:, None] * 32 + bits[None, :]
        off = tl.reshape(tokens, (BLOCK,))
        clear = tl.reshape((allowed == 0) & (tokens < vocab), (BLOCK,))
        neg_inf = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * logits_stride + off, neg_inf, mask=clear)


def apply_token_mask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                            active: torch.Tensor | int | None = None) -> torch.Tensor:
    rows = _check(logits, bitmask, active)
    v = logits.shape[1]
    if rows == 0 or v == 0:
        return logits
    has_active = isinstance(active, torch.Tensor)
    on = use_pdl(logits)
    _token_mask_kernel[(rows, triton.cdiv(v, BLOCK_TOKENS))](
        logits, logits.stride(0), bitmask, bitmask.stride(0), active if has_active else bitmask, v,
        HAS_ACTIVE=has_active, BLOCK=BLOCK_TOKENS, USE_PDL=on, launch_pdl=on, num_warps=4)
    return logits


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor,
                     active: torch.Tensor | int | None = None) -> torch.Tensor:
    """Sets the logits of tokens the bitmask disallows to -inf, in place; returns `logits`."""
    if use_triton(logits):
        return apply_token_mask_triton(logits, bitmask, active)
    return apply_token_mask_ref(logits, bitmask, active)
