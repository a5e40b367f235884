"""The sort of (token, slot) pairs by expert that the grouped expert GEMMs need (`MoE._grouped`).

Semantics (the reference): `sort_tokens_ref(ids [T, k], E)` → (order [T·k] int64: flat pair indices
stably sorted by expert, identical to `ids.reshape(-1).argsort(stable=True)`; offs [E] int32: the end
of each expert's group in `order`).

Kernels: `_sort_histogram_kernel` + `_sort_scatter_kernel`. Per block of HIST_BLOCK pairs a histogram
over experts; the last block to finish (an atomic ticket, as the split-K reduce of `gemv.py`) turns the
histograms into per-(block, expert) bases (an exclusive scan down each expert's column) and the
experts' starts and ends (`offs`), and resets the counter; then each pair's position is start[e] +
base[block, e] + the pairs of expert e before it in its block, counted by comparison. No atomic decides
a position, so `order` is exactly the stable argsort, whatever the batch or the timing.

CUDA graphs: grids come from shapes; the counter is a one-element workspace the kernel leaves at zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels import use_pdl, use_triton
from strata.kernels.moe_routing import MAX_EXPERTS
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, tl, triton


@dataclass(frozen=True)
class SortConfig:
    hist_block: int = 1024  # pairs per histogram (one row of the base table)
    rank_block: int = 64  # pairs per scatter program; divides hist_block
    scan_rows: int = 16  # table rows per step of the scan


def sort_tokens_workspace(device) -> torch.Tensor:
    """A zeroed counter for `sort_tokens`; the kernel leaves it at zero after each call."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def sort_tokens_ref(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T·k] int64, offs [E] int32) exactly as `MoE._grouped` computes them."""
    flat_ids = ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=flat_ids.dtype)
    offs = torch.searchsorted(flat_ids[order], experts, right=True, out_int32=True)
    return order, offs


@jit(do_not_specialize=["n_pairs", "n_blocks"])
def _sort_histogram_kernel(ids_ptr, n_pairs, n_experts, n_blocks, table_ptr, counter_ptr, offs_ptr,
                           HIST_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, SCAN_ROWS: tl.constexpr,
                           USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    block = tl.program_id(0)
    idx = block * HIST_BLOCK + tl.arange(0, HIST_BLOCK)
    ok = idx < n_pairs
    expert = tl.load(ids_ptr + idx, mask=ok, other=0).to(tl.int32)
    counts = tl.histogram(expert, BLOCK_E, mask=ok & (expert >= 0) & (expert < n_experts))
    cols = tl.arange(0, BLOCK_E)
    tl.store(table_ptr + block * BLOCK_E + cols, counts)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_blocks - 1:
        # Rows 0..n_blocks-1 become the pairs of each expert in earlier blocks; row n_blocks the
        # experts' starts in `order`.
        seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for r0 in range(0, n_blocks, SCAN_ROWS):
            r = r0 + tl.arange(0, SCAN_ROWS)
            ptrs = table_ptr + r[:, None] * BLOCK_E + cols[None, :]
            c = tl.load(ptrs, mask=(r < n_blocks)[:, None], other=0, cache_modifier=".cg")
            tl.store(ptrs, seen[None, :] + tl.cumsum(c, axis=0) - c, mask=(r < n_blocks)[:, None])
            seen += tl.sum(c, axis=0)
        ends = tl.cumsum(seen, axis=0)
        tl.store(offs_ptr + cols, ends, mask=cols < n_experts)
        tl.store(table_ptr + n_blocks * BLOCK_E + cols, ends - seen)
        tl.store(counter_ptr, 0)


@jit(do_not_specialize=["n_pairs", "n_blocks"])
def _sort_scatter_kernel(ids_ptr, n_pairs, n_blocks, table_ptr, order_ptr, HIST_BLOCK: tl.constexpr,
                         RANK_BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    first = tl.program_id(0) * RANK_BLOCK
    block = first // HIST_BLOCK
    lanes = tl.arange(0, RANK_BLOCK)
    idx = first + lanes
    ok = idx < n_pairs
    expert = tl.load(ids_ptr + idx, mask=ok, other=-1).to(tl.int32)
    # Pairs of the same expert before this one in its histogram block: earlier chunks, then this one.
    before = tl.sum(((expert[None, :] == expert[:, None]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
    for j0 in range(block * HIST_BLOCK, first, RANK_BLOCK):
        earlier = tl.load(ids_ptr + j0 + lanes).to(tl.int32)
        before += tl.sum((earlier[None, :] == expert[:, None]).to(tl.int32), axis=1)
    start = tl.load(table_ptr + n_blocks * BLOCK_E + expert, mask=ok, other=0)
    base = tl.load(table_ptr + block * BLOCK_E + expert, mask=ok, other=0)
    tl.store(order_ptr + start + base + before, idx.to(tl.int64), mask=ok)


def sort_tokens_triton(ids: torch.Tensor, num_experts: int, *, workspace: torch.Tensor | None = None,
                       config: SortConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (int32/int64, each in [0, E): not checked, that would read them on the host) →
    (order [T·k] int64, offs [E] int32), equal to `sort_tokens_ref`, in two launches. `workspace`:
    `sort_tokens_workspace` (without one, a zeroed counter is allocated per call)."""
    if ids.dtype not in (torch.int32, torch.int64) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"ids: expected int32/int64 and 1 <= E <= {MAX_EXPERTS}, got {ids.dtype}, E={num_experts}")
    cfg = config or SortConfig()
    if cfg.hist_block % cfg.rank_block:
        raise ValueError(f"{cfg}: rank_block must divide hist_block")
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n == 0:
        return order, torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    if workspace is None:
        workspace = sort_tokens_workspace(ids.device)
    elif workspace.dtype != torch.int32 or workspace.numel() < 1:
        raise ValueError("workspace: expected an int32 tensor (sort_tokens_workspace)")
    offs = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    block_e = triton.next_power_of_2(num_experts)
    n_blocks = triton.cdiv(n, cfg.hist_block)
    table = torch.empty((n_blocks + 1) * block_e, dtype=torch.int32, device=ids.device)
    on = use_pdl(ids)
    _sort_histogram_kernel[(n_blocks,)](flat, n, num_experts, n_blocks, table, workspace, offs,
                                        HIST_BLOCK=cfg.hist_block, BLOCK_E=block_e, SCAN_ROWS=cfg.scan_rows,
                                        USE_PDL=on, launch_pdl=on, num_warps=4)
    _sort_scatter_kernel[(triton.cdiv(n, cfg.rank_block),)](flat, n, n_blocks, table, order, HIST_BLOCK=cfg.hist_block,
                                                      RANK_BLOCK=cfg.rank_block, BLOCK_E=block_e, USE_PDL=on,
                                                      launch_pdl=on, num_warps=4)
    return order, offs


def sort_tokens(ids: torch.Tensor, num_experts: int, *,
                workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels for CUDA ids they serve, the reference elsewhere."""
    if use_triton(ids) and ids.dtype in (torch.int32, torch.int64) and 1 <= num_experts <= MAX_EXPERTS:
        return sort_tokens_triton(ids, num_experts, workspace=workspace)
    return sort_tokens_ref(ids, num_experts)
