"""FP8 weights for HF checkpoints (`--quantize fp8`): e4m3 values with one fp32 scale per output
channel, made at load from the model's own weights.

It follows the format-module contract of `strata.kernels.quant` with one difference: its "raw" input
is the dense weight itself ([N, K], any float dtype; BLOCK_VALUES = BLOCK_BYTES = 1 so stacks of rows
concatenate as blocks do), which `repack` quantizes per row on the device.

`matmul` quantizes x per row too (dynamic, e4m3, scale = amax / 448) and runs `torch._scaled_mm` with
row-wise scales: the H200's FP8 tensor cores through cuBLASLt, the maintained path, at half the weight
bytes of bf16. fp32 x on CUDA (correctness runs) takes the reference: dequantize, then matmul.

MoE experts (`quantize_experts`, `grouped_matmul`): each expert's [N, K] weight per output channel
likewise, and the tokens sorted by expert go through `torch._scaled_grouped_mm` on CUDA (one launch for
all experts, no host sync); elsewhere a loop over the experts' row ranges (the reference).
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
