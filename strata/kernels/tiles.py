"""Tile orders shared by the GEMM kernels."""

from __future__ import annotations

from strata.kernels.triton_import import jit, tl


@jit
def grouped_tile(pid, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid`: GROUP_M row tiles walk the column tiles together, so
    a weight tile is read from HBM once and reused from L2 by its neighbours."""
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows
