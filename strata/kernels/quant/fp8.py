"""FP8 weights for HF checkpoints (`--quantize fp8`): e4m3 values with one fp32 scale per output
channel, made at load from the model's own weights.

It follows the format-module contract of `strata.kernels.quant` with one difference: its "raw" input
is the dense weight itself ([N, K], any float dtype; BLOCK_VALUES = BLOCK_BYTES = 1 so stacks of rows
concatenate as blocks do), which `repack` quantizes per row on the device.

`matmul` quantizes x per row too (dynamic, e4m3, scale = amax / 448) and runs `torch._scaled_mm` with
row-wise scales: the H200's FP8 tensor cores through cuBLASLt, the maintained path, at half the weight
bytes of bf16. fp32 x on CUDA (correctness runs) takes the reference: dequantize, then matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GGML_TYPE = "FP8"  # Strata's own name: not a GGUF type
BLOCK_VALUES = 1
BLOCK_BYTES = 1
E4M3_MAX = 448.0
_ROW_MULTIPLE = 16  # cuBLASLt's FP8 GEMM wants every dimension a multiple of 16


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], fp32 scale [M]) with x ≈ q * scale per row."""
    x32 = x.float()
    scale = x32.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
    return (x32 / scale[:, None]).to(torch.float8_e4m3fn), scale


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


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ Wᵀ → [..., N] in x's dtype."""
    if x.is_cuda and x.dtype == torch.float32:
        return matmul_ref(x, planes, n, k, out)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xq, xs = _quantize_rows(x2)
    pad = -m % _ROW_MULTIPLE if x.is_cuda else 0
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, k)])
        xs = torch.cat([xs, xs.new_ones(pad)])
    y = torch._scaled_mm(xq, planes["w"].t(), scale_a=xs[:, None], scale_b=planes["scale"][None, :],
                         out_dtype=x.dtype)
    y = y[:m].view(*x.shape[:-1], n)
    return y if out is None else out.copy_(y)


def random_raw(n: int, k: int, seed: int):
    """A dense random weight (the format's raw input) for tests: N(0, 0.02) in fp32."""
    g = torch.Generator().manual_seed(seed)
    return (0.02 * torch.randn(n, k, generator=g)).numpy()
