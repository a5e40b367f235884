"""Split-K in one launch, shared by the decode GEMVs (`gemv.py`, `quant/q4_k.py`, `quant/iq3_s.py`).

Program (tile, split) of a split-K grid stores its fp32 partial, then takes a ticket from the tile's
counter; the program that arrives last, whichever it is, sums the partials in split order 0, 1, ...
(so the bits never depend on arrival order), resets the counter to zero for the next launch and
writes the output. No second launch, and a workspace is reusable by the next call on the same stream.
"""

from __future__ import annotations

import torch

from strata.kernels.triton_import import jit, tl


@jit
def split_k_reduce(acc, partial_ptr, counter_ptr, tile, split, rows, offs_n, row_ok,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] fp32 (weights on the MMA's M side, x rows on N). Partials live at
    partial_ptr as [tiles, SPLIT_K, BLOCK_M, BLOCK_N] (rows with row_ok only); counters one int32 per
    tile, zero between launches. Returns (last, total): in the last-arriving program True and the sum
    of every split's partial, elsewhere False and acc."""
    tile_partials = partial_ptr + tile * (SPLIT_K * BLOCK_M * BLOCK_N) + rows[None, :] * BLOCK_N + offs_n[:, None]
    tl.store(tile_partials + split * (BLOCK_M * BLOCK_N), acc, mask=row_ok[None, :])
    # Every thread's partial stores are ordered before thread 0's release (the atomic runs on one
    # thread), the pattern of a cooperative grid sync.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = acc
    if last:
        # ".cg" reads L2, where the other SMs' stores are, never a stale L1 line.
        total = tl.load(tile_partials, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(tile_partials + s * (BLOCK_M * BLOCK_N), mask=row_ok[None, :], other=0.0,
                             cache_modifier=".cg")
        tl.store(counter_ptr + tile, 0)
    return last, total


@jit
def split_k_range(k_steps, SPLIT_K: tl.constexpr):
    """(tile, split, first K step, end K step) of this program in a grid of column tiles × SPLIT_K:
    split s covers steps [s · k_steps / SPLIT_K, (s + 1) · k_steps / SPLIT_K)."""
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    return pid // SPLIT_K, split, split * k_steps // SPLIT_K, (split + 1) * k_steps // SPLIT_K


@jit
def split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores acc [BLOCK_N, BLOCK_M] (weight rows `cols` × x rows `rows`) as out[rows, cols] in out's
    dtype: at once without split-K, else the sum of the splits' partials by the last program to arrive."""
    row_ok = rows < m
    out_ptrs = out_ptr + rows[None, :] * out_stride + cols[:, None]
    out_ok = (cols < n)[:, None] & row_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        last, total = split_k_reduce(acc, partial_ptr, counter_ptr, tile, split, rows, cols - tile * BLOCK_N,
                                     row_ok, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)


# ---- the host side: one workspace layout for every kernel that uses split_k_reduce ---------------

def split_k_parts(n: int, block_n: int, split_k: int, block_m: int) -> tuple[int, int]:
    """(counter slots, partial elements) of one launch's workspace, in int32 elements: one counter per
    column tile, padded to 32 (128 bytes), and fp32 partials [tiles, split_k, block_m, block_n];
    (0, 0) without split-K."""
    if split_k == 1:
        return 0, 0
    tiles = -(-n // block_n)
    return -(-tiles // 32) * 32, tiles * split_k * block_m * block_n


def split_k_numel(n: int, block_n: int, split_k: int, block_m: int) -> int:
    """int32 elements of a workspace for one shape: its counters, then its partials; 0 without split-K."""
    return sum(split_k_parts(n, block_n, split_k, block_m))


def shared_split_k_numel(parts) -> int:
    """int32 elements of one workspace shared by launches of several shapes that run one after another
    (`split_k_parts` of each): the largest counter region, then the largest partial region. Counters
    sit at the start and partials at the end of the workspace (`split_k_views`), so no shape's partials
    can land on another shape's counters, which must stay zero between launches."""
    parts = list(parts)
    return max((c for c, _ in parts), default=0) + max((p for _, p in parts), default=0)


def split_k_views(workspace: torch.Tensor | None, n: int, block_n: int, split_k: int, block_m: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """(counters, partials) of `workspace` for one launch: counters at its start, partials at its end;
    None allocates a zeroed one (inside a CUDA graph capture, from the graph's pool). The kernel leaves
    the counters at zero after each launch."""
    counter_slots, partial_numel = split_k_parts(n, block_n, split_k, block_m)
    need = counter_slots + partial_numel
    if workspace is None:
        workspace = torch.zeros(need, dtype=torch.int32, device=device)
    elif workspace.dtype != torch.int32 or workspace.numel() < need or not workspace.is_contiguous():
        raise ValueError(f"workspace: expected a contiguous int32 tensor of >= {need} elements")
    tiles = -(-n // block_n)
    return workspace[:tiles], workspace[workspace.numel() - partial_numel :].view(torch.float32)
