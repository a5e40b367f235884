"""FP8 weights for HF checkpoints (`--quantize fp8`): e4m3 values with one fp32 scale per output
channel, made at load from the model's own weights.

It follows the format-module contract of `strata.kernels.quant` with one difference: its "raw" input
is the dense weight itself ([N, K], any float dtype; BLOCK_VALUES = BLOCK_BYTES = 1 so stacks of rows
concatenate as blocks do), which `repack` quantizes per row on the device.

`matmul` has two paths, which round differently:
- Decode (x of 1-16 rows in bf16 / fp16, on CUDA or in the interpreter): weight-only, through the
  decode GEMV of `strata.kernels.gemv` with its scaled 8-bit weights (`gemv`): x stays in its dtype,
  each e4m3 weight becomes x's dtype exactly, the products are summed in fp32 and the row's scale
  multiplies the sum once before the one rounding to x's dtype; so it equals the reference
  `matmul_ref` up to the fp32 summation order. Batch invariant like the bf16 GEMV (configuration from
  (N, K) and the device only, `gemv_config`), split-K through `workspace` (`gemv_workspace_numel`: `QWeight` keeps
  one per weight, so no call allocates).
- Reads (more rows), and decode where the GEMV does not serve: x quantized per row too (dynamic, e4m3,
  scale = amax / 448) and `torch._scaled_mm` with row-wise scales, the H200's FP8 tensor cores
  through cuBLASLt. Its activations lose precision (3 mantissa bits): on random data a row's result
  is ~3% (root mean square) off the decode path's and the reference's, so the same token's logits
  differ between a decode step and a read or a step of more than 16 rows.
fp32 x on CUDA (correctness runs) takes the reference: dequantize, then matmul. `silu_mul_matmul` is
`matmul(silu_mul(gate_up))` for a SwiGLU down projection, with a read's quantization done straight from
gate|up (`fp8_rows.silu_mul_quantize_rows_triton`: the same codes, one pass less over memory).

MoE experts (`quantize_experts`, `grouped_matmul`): each expert's [N, K] weight per output channel
likewise, and the tokens sorted by expert go through `torch._scaled_grouped_mm` on CUDA (one launch for
all experts, no host sync); elsewhere a loop over the experts' row ranges (the reference).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from strata.kernels import device as devices
from strata.kernels import gemv as k_gemv
from strata.kernels import kernels_run
from strata.kernels.device import DeviceSpec
from strata.kernels.gemv import GemvConfig
from strata.kernels.quant.fp8_rows import E4M3_MAX, quantize_rows

GGML_TYPE = "FP8"  # Strata's own name: not a GGUF type
BLOCK_VALUES = 1
BLOCK_BYTES = 1
_ROW_MULTIPLE = 16  # cuBLASLt's FP8 GEMM wants every dimension a multiple of 16


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], fp32 scale [M]) with x ≈ q * scale per row (`fp8_rows`). On a CUDA
    device without e4m3 conversions (before sm_89) it refuses: the quantizing kernel does not compile
    there (Triton's fp8e4nv), nor do the reads' torch._scaled_mm and the experts' FP8 decode kernels run."""
    spec = devices.current(x)
    if x.is_cuda and not spec.fp8:
        raise RuntimeError(f"FP8 weights (--quantize fp8) need e4m3 support, sm_89 or later (Ada, Hopper); "
                           f"{spec.name} is sm_{spec.arch}")
    return quantize_rows(x if x.stride(-1) == 1 else x.contiguous())


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The dense weight [N, K] → planes {"w": e4m3 [N, K], "scale": fp32 [N]}."""
    w, scale = _quantize_rows(raw)
    return {"w": w.contiguous(), "scale": scale.contiguous()}


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    w, scale = planes["w"], planes["scale"]
    if tuple(w.shape) != (n, k):
        raise ValueError(f"FP8 planes of shape {tuple(w.shape)}, expected ({n}, {k})")
    return w.float() * scale[:, None]


def matmul_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x.float(), dequantize(planes, n, k)).to(x.dtype)
    return y if out is None else out.copy_(y)


# Decode GEMV configurations tuned on the device (`python benchmarks/kernels/fp8.py --sweep`, H200:
# mean of M = 1, 4, 8; the rule's configuration's time after each); shapes not listed take
# `gemv_config`'s rule (gate_up 24576x4096 is listed nowhere: the rule's 64x256 was the sweep's best).
GEMV_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (6144, 4096): GemvConfig(64, 128, split_k=4, num_stages=3),  # qkv: 13.53 us (rule 15.94)
    (4096, 4096): GemvConfig(64, 128, split_k=4, num_stages=4),  # o_proj: 11.51 us (12.14)
    (4096, 12288): GemvConfig(64, 128, split_k=8, num_stages=4),  # down: 19.57 us (20.23)
    (5120, 2048): GemvConfig(64, 128, split_k=4, num_stages=3),  # Qwen3-30B-A3B qkv: 10.06 us (11.56)
    (2048, 4096): GemvConfig(64, 128, split_k=8, num_stages=3),  # Qwen3-30B-A3B o_proj: 9.41 us (9.52)
}


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> GemvConfig:
    """The decode GEMV's configuration for weight [N, K] on `spec` (default: the current device), a
    function of (N, K) only for a device (batch invariance): the table's on the reference device, else
    the bf16 GEMV's (its grid and split-K for the device) with BLOCK_K doubled while every program
    keeps >= 4 K blocks, so a pipeline stage moves as many weight bytes as in bf16, in the stages that
    fit the device. E.g. the Qwen3-8B shapes on the H200's rule: qkv 64x256 split 2, o_proj 64x256
    split 4, gate_up 64x256, down 128x128 split 8 (compiled for sm_90: 56-86 KB of shared memory,
    136-150 registers, no spills); not timed."""
    spec = spec or devices.current()
    if devices.tuned(spec) and (n, k) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(n, k)]
    cfg = k_gemv.gemv_config(n, k, spec)
    if k % (2 * cfg.block_k) == 0 and k // (2 * cfg.block_k) // cfg.split_k >= 4:
        cfg = replace(cfg, block_k=2 * cfg.block_k)
    return k_gemv.fit(cfg, spec, w_bytes=1)


def gemv_supported(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    return k_gemv.gemv_supported(m, n, k, dtype)


def gemv_workspace_numel(n: int, k: int, spec: DeviceSpec | None = None) -> int:
    """int32 elements of the decode GEMV's split-K workspace for weight [N, K] (0 without split-K, or
    where the GEMV does not serve): `QWeight.from_raw` makes one per weight."""
    if not gemv_supported(1, n, k, torch.bfloat16):
        return 0
    return k_gemv.gemv_workspace_numel(n, k, gemv_config(n, k, spec))


def gemv(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None, *,
         workspace: torch.Tensor | None = None, config: GemvConfig | None = None,
         w8_conversion: str = "asm") -> torch.Tensor:
    """The weight-only decode kernel: x [M ≤ 16, K] bf16 / fp16 (contiguous rows) → out [M, N] in x's
    dtype, (x @ wᵀ) · scale (module docstring). `workspace`: zeroed int32 of >= `gemv_workspace_numel`
    elements, left zeroed (not shared by concurrent streams); None allocates one per call.
    `w8_conversion`: see `strata.kernels.gemv.gemv_triton`."""
    return k_gemv.gemv_triton(x, planes["w"], None, out, workspace=workspace,
                              config=config or gemv_config(n, k, devices.current(x)), scale=planes["scale"],
                              w8_conversion=w8_conversion)


def _gemv_serves(x2: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int) -> bool:
    return (gemv_supported(x2.shape[0], n, k, x2.dtype) and x2.stride(1) == 1 and planes["w"].is_contiguous()
            and kernels_run(x2, k_gemv._gemv_kernel))


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
           out: torch.Tensor | None = None, *, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ Wᵀ → [..., N] in x's dtype: the decode GEMV for 1-16 rows where it serves, else
    per-token FP8 through torch._scaled_mm (module docstring). `workspace`: see `gemv`."""
    if x.is_cuda and x.dtype == torch.float32:
        return matmul_ref(x, planes, n, k, out)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if _gemv_serves(x2, planes, n, k):
        direct = out is not None and out.dim() == 2 and out.stride(1) == 1
        y = gemv(x2, planes, n, k, out if direct else None, workspace=workspace)
        if out is None:
            return y.view(*x.shape[:-1], n)
        return out if direct else out.copy_(y.view(out.shape))
    return scaled_mm_matmul(x, planes, n, k, out)


def scaled_mm_matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The reads' path: x quantized per row, then torch._scaled_mm (module docstring)."""
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xq, xs = quantize_rows(x2 if x2.stride(1) == 1 else x2.contiguous(), -m % _ROW_MULTIPLE if x.is_cuda else 0)
    y = _scaled_mm_rows(xq, xs, planes, m, x.dtype).view(*x.shape[:-1], n)
    return y if out is None else out.copy_(y)


def _scaled_mm_rows(xq: torch.Tensor, xs: torch.Tensor, planes: dict[str, torch.Tensor], m: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The first m rows of (xq · xs) @ (w · scale)ᵀ through torch._scaled_mm with row-wise scales."""
    return torch._scaled_mm(xq, planes["w"].t(), scale_a=xs[:, None], scale_b=planes["scale"][None, :],
                            out_dtype=dtype)[:m]


def silu_mul_matmul(gate_up: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, *,
                    workspace: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up @ Wᵀ for gate_up [M, 2K] (a SwiGLU MLP's down projection) → [M, N], the same
    values as `matmul(silu_mul(gate_up), ...)`. Reads on CUDA quantize the product straight from gate|up
    (`fp8_rows.silu_mul_quantize_rows_triton`: the same codes, without the bf16 product's round trip
    through memory); decode rows and other devices take the two steps."""
    from strata.kernels.activation import silu_mul
    from strata.kernels.quant.fp8_rows import silu_mul_quantize_rows_triton, silu_mul_quantize_serves

    m = gate_up.shape[0]
    if not silu_mul_quantize_serves(gate_up) or gemv_supported(m, n, k, gate_up.dtype):
        return matmul(silu_mul(gate_up), planes, n, k, workspace=workspace)
    xq, xs = silu_mul_quantize_rows_triton(gate_up, -m % _ROW_MULTIPLE)
    return _scaled_mm_rows(xq, xs, planes, m, gate_up.dtype)


def random_raw(n: int, k: int, seed: int):
    """A dense random weight (the format's raw input) for tests: N(0, 0.02) in fp32."""
    g = torch.Generator().manual_seed(seed)
    return (0.02 * torch.randn(n, k, generator=g)).numpy()


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] → (e4m3 [E, N, K], fp32 scale [E, N])."""
    e, n, k = w.shape
    q, scale = _quantize_rows(w.reshape(e * n, k))
    return q.view(e, n, k), scale.view(e, n)


def grouped_matmul(xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of xs [M, K] sorted by expert (`offs` [E]: each expert's end row, int32) times their expert's
    weight: [M, N] in xs's dtype."""
    xq, xs_scale = _quantize_rows(xs)
    if xs.is_cuda and xs.dtype != torch.float32:
        return torch._scaled_grouped_mm(xq, w.transpose(-2, -1), xs_scale, scale, offs=offs, out_dtype=xs.dtype)
    return grouped_matmul_ref(xs, w, scale, offs)


def grouped_silu_mul_matmul(h13: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_matmul(silu_mul(h13), ...)` for the experts' down projection (h13 [M, 2K]: gate|up rows
    sorted by expert), the product quantized straight from gate|up on CUDA (the same codes)."""
    from strata.kernels.activation import silu_mul
    from strata.kernels.quant.fp8_rows import silu_mul_quantize_rows_triton, silu_mul_quantize_serves

    if silu_mul_quantize_serves(h13):
        xq, xs_scale = silu_mul_quantize_rows_triton(h13)
        return torch._scaled_grouped_mm(xq, w.transpose(-2, -1), xs_scale, scale, offs=offs, out_dtype=h13.dtype)
    return grouped_matmul(silu_mul(h13), w, scale, offs)


def grouped_matmul_ref(xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = xs.new_empty(xs.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            planes = {"w": w[e], "scale": scale[e]}
            out[start:end] = matmul(xs[start:end], planes, w.shape[1], w.shape[2]) if not xs.is_cuda else \
                matmul_ref(xs[start:end], planes, w.shape[1], w.shape[2])
        start = end
    return out
