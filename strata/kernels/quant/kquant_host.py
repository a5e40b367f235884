"""Host code the K-quant formats share (`q4_k.py`, `q6_k.py`, `q5_k.py`; `q4_0.py` too, with 32-value
K steps): their configuration types and tile heuristics, the argument checks, the size of the decode
workspace and the launchers of their GEMV and GEMM kernels. Each format module keeps its planes, its
kernels and its public names, and passes in what differs: plane names and shapes, the kernels and
their plane arguments, the dp4a module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels import device as devices
from strata.kernels import use_pdl
from strata.kernels.device import DeviceSpec
from strata.kernels.quant.dp4a import Dp4aConfig, shared_workspace_numel
from strata.kernels.splitk import split_k_numel, split_k_parts, split_k_views

BLOCK_VALUES = 256  # values per super-block, in every K-quant format
GEMV_MAX_ROWS = 16  # x is padded to this many rows: the MMA's N side in the swap-AB GEMV
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per program (the MMA's M side): 16, 32, 64 or 128
    block_k: int  # values per step, a power of two >= 128 dividing K
    split_k: int = 1  # programs per row tile, each over an equal share (±1) of the K steps
    num_stages: int = 4

    @property
    def num_warps(self) -> int:
        # One warp per 16 weight rows. The dequantized tile is produced directly in the MMA operand
        # layout, and the MMA gives each warp 16 rows: more warps than BLOCK_N/16 would hold copies
        # of the same rows and repeat the whole dequantization per copy (seen in the sm_90 SASS).
        return self.block_n // 16

    def programs(self, n: int) -> int:
        return cdiv(n, self.block_n) * self.split_k


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int  # values per step, a power of two >= 128 dividing K
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


def split_gemv_config(n: int, k: int, block_k: int, spec: DeviceSpec | None = None) -> GemvConfig:
    """`block_k` values per step; 64-row tiles (one wgmma warp group), 128 rows once those alone give
    two programs per SM; split-K up to about 3 programs per SM with ≥ 2 steps per program (the
    reasoning at `q4_k.GEMV_CONFIGS`), on `spec`'s SM count (default: the current device's)."""
    sms = (spec or devices.current()).sm_count
    block_n = 128 if cdiv(n, 128) >= 2 * sms else 64
    steps, tiles = k // block_k, cdiv(n, block_n)
    split = max(1, min(3 * sms // tiles, steps // 2))
    return GemvConfig(block_n, block_k, split, num_stages=3 if block_k == 256 else 4)


def tiled_gemm_config(m: int, dtype: torch.dtype, fp32_tile: int, spec: DeviceSpec | None = None) -> GemmConfig:
    """16-bit x: 128x128 output tiles (64 rows for M ≤ 64), 8 warps, 128 values per step, 3 stages.
    On a device without `wgmma` (`spec`, default: the current device) the dequantized tile and the
    accumulator both sit in registers for mma.sync, and 128-row tiles spill (Q4_K ~150 spill
    instructions compiled for sm_86): 64 rows at every M there, as many of the 3 stages as fit its
    shared memory (a stage: 16 KB of x, at most 16 KB of planes). fp32 x: square `fp32_tile` tiles,
    the largest that the format's FMA dot compiles without (much) spilling, 2 stages."""
    if dtype == torch.float32:
        return GemmConfig(fp32_tile, fp32_tile, 128, num_warps=8, num_stages=2)
    spec = spec or devices.current()
    if not spec.wgmma:
        return GemmConfig(64, 128, 128, num_warps=8, num_stages=devices.fit_stages(spec, 3, 32 << 10))
    return GemmConfig(64 if m <= 64 else 128, 128, 128, num_warps=8, num_stages=3)


def decode_workspace_numel(n: int, k: int, config: GemvConfig | None,
                           gemv_config: Callable[[int, int], GemvConfig],
                           dp4a_config: Callable[[int, int], Dp4aConfig], spec: DeviceSpec | None = None) -> int:
    """int32 elements of the split-K workspace of the GEMV under `config`; without one, of a workspace
    that the format's dequantizing GEMV (`gemv_config`) and its dp4a GEMV (`dp4a_config`) can both use
    on `spec` (default: the current device)."""
    if config is not None:
        return split_k_numel(n, config.block_n, config.split_k, GEMV_MAX_ROWS)
    with devices.using(spec or devices.current()):
        cfg = gemv_config(n, k)
        parts = split_k_parts(n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS)
        return shared_workspace_numel(n, parts, dp4a_config(n, k))


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition


def random_block_bytes(n: int, k: int, seed: int, block_bytes: int) -> tuple[np.random.Generator, np.ndarray]:
    """uint8 [N·K/256, block_bytes] of uniform random bytes, and the generator that drew them (the
    format then draws its scale fields from it)."""
    if k % BLOCK_VALUES:
        raise ValueError(f"K={k} is not a multiple of {BLOCK_VALUES}")
    rng = np.random.default_rng(seed)
    return rng, rng.integers(0, 256, size=(n * (k // BLOCK_VALUES), block_bytes), dtype=np.uint8)


def check_raw(ggml_type: str, raw: torch.Tensor, block_bytes: int) -> tuple[int, int]:
    """(N, super-blocks per row) of a weight's raw blocks."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"{ggml_type} raw: expected uint8 [N, K/{BLOCK_VALUES}·{block_bytes}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return raw.shape[0], raw.shape[1] // block_bytes


def check_planes(ggml_type: str, planes: dict[str, torch.Tensor], k: int,
                 want: dict[str, tuple[tuple[int, int], torch.dtype]]) -> None:
    """Each plane named in `want` is there, contiguous, of its (shape, dtype)."""
    if k % BLOCK_VALUES:
        raise ValueError(f"K={k} is not a multiple of {BLOCK_VALUES}")
    for name, (shape, dtype) in want.items():
        t = planes.get(name)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"{ggml_type} plane {name!r}: expected contiguous {dtype} {shape}, got {got}")


def reference_matmul(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The formats' semantics given the fp32 weight w [N, K]: the fp32 product of x and w rounded to
    x's dtype, rounded once."""
    y = F.linear(x.float(), w.to(x.dtype).float()).to(x.dtype)
    return y if out is None else out.copy_(y)


# ----------------------------------------------------------------------------------------------
# Launchers


def check_block_k(block_k: int, k: int, least: int = 128) -> None:
    if block_k < least or block_k & (block_k - 1) or k % block_k:
        raise ValueError(f"block_k={block_k}: a power of two >= {least} dividing K={k} expected")


def check_x_out(x: torch.Tensor, device: torch.device, n: int, k: int, out: torch.Tensor | None,
                allocate: bool = True) -> torch.Tensor | None:
    """x [M, K] and out [M, N] of a product with a weight on `device` (the K-quant formats share it):
    `out`, or a new one when `allocate`, or None."""
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x: expected [M, {k}] bf16/fp16/fp32 with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.device != device:
        raise ValueError(f"x on {x.device}, weight on {device}")
    m = x.shape[0]
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device) if allocate else None
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out: expected [{m}, {n}] {x.dtype} with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    return out


def _launch_options(x: torch.Tensor, cfg: GemvConfig | GemmConfig, constexprs: dict) -> dict:
    on = use_pdl(x)
    return dict(IEEE_DOT=x.dtype == torch.float32, USE_PDL=on, launch_pdl=on, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **constexprs)


def launch_gemv(kernel, name: str, x: torch.Tensor, weights: tuple, n: int, k: int, out: torch.Tensor,
                workspace: torch.Tensor | None, cfg: GemvConfig, *, least_block_k: int = 128,
                **constexprs) -> torch.Tensor:
    """Checks M ≤ GEMV_MAX_ROWS and `cfg`, then runs a swap-AB GEMV kernel of the K-quant formats on x
    and `out` (both checked by the caller): (x, x_stride, *weights, out, out_stride, partials,
    counters, m, n, k) and the constexprs BLOCK_M/N/K, SPLIT_K, IEEE_DOT, USE_PDL and `constexprs`.
    Split-K uses `workspace` (zeroed int32, left zeroed) or allocates one. `least_block_k`: the
    format's least K step (Q4_0's 32-value blocks take 32)."""
    m = x.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"{name}: M={m} > {GEMV_MAX_ROWS}")
    check_block_k(cfg.block_k, k, least_block_k)
    if cfg.block_n not in (16, 32, 64, 128) or not 1 <= cfg.split_k <= k // cfg.block_k:
        raise ValueError(f"invalid {cfg} for K={k}")
    if m == 0 or n == 0:
        return out
    counters = partials = out  # placeholders, untouched without split-K
    if cfg.split_k > 1:
        counters, partials = split_k_views(workspace, n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS, x.device)
    kernel[(cdiv(n, cfg.block_n) * cfg.split_k,)](
        x, x.stride(0), *weights, out, out.stride(0), partials, counters, m, n, k,
        BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        **_launch_options(x, cfg, constexprs))
    return out


def launch_gemm(kernel, x: torch.Tensor, weights: tuple, n: int, k: int, out: torch.Tensor, cfg: GemmConfig,
                *, least_block_k: int = 128, **constexprs) -> torch.Tensor:
    """Checks `cfg`, then runs a tiled GEMM kernel of the K-quant formats on x and `out` (both checked by
    the caller): (x, x_stride, *weights, out, out_stride, m, n, k) and the constexprs BLOCK_M/N/K,
    GROUP_M, IEEE_DOT, USE_PDL and `constexprs`; `least_block_k` as `launch_gemv`'s."""
    m = x.shape[0]
    check_block_k(cfg.block_k, k, least_block_k)
    if m == 0 or n == 0:
        return out
    kernel[(cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)](
        x, x.stride(0), *weights, out, out.stride(0), m, n, k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        **_launch_options(x, cfg, constexprs))
    return out
