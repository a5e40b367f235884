"""Routed experts held in host RAM and computed on the CPU (`--cpu-moe`, `--n-cpu-moe N`).

A MoE layer whose routed experts the memory plan leaves in RAM keeps them here, in a format that one
of torch's maintained CPU kernels reads (no hand-written SIMD):

- "float": the model's dtype (fp32 or bf16) through `F.linear` (oneDNN); the only exact format, so a
  float file gives the same experts on the GPU and in RAM;
- "int8": int8 with one scale per output row, through `torch._weight_int8pack_mm` — for files of 6 bits
  or more (Q8_0, Q6_K, Q5_K);
- "int4": int4 in groups of 32 values with a scale and an offset per group, through
  `torch._weight_int4pack_mm_for_cpu` — for the files of 4.5 bits or fewer (Q4_K, Q4_0, IQ4_XS, Q3_K,
  IQ3_S), whose weights it holds at least as finely as the file does.

Activations are fp32 on the CPU. A step's (token, expert) pairs are grouped by expert, so each expert
the step chose runs two matmuls over all of its rows; the weighted sum over a token's experts is
taken in fp32 and returned for the caller to add on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORMATS = ("float", "int8", "int4")
INT4_GROUP = 32
# The int4 CPU kernel packs rows in tiles of 16 and groups of INT4_GROUP values: shapes it can take.
INT4_ROW_TILE = 16


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 [N, K], fp32 scale [N]) with w ≈ q * scale, the scale from each row's
    largest magnitude."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int32 levels 0..15 [N, K], fp32 scales_and_zeros [K / group, N, 2]) with
    w ≈ (q - 8) * scale + zero per group (the convention of torch's int4 kernels): the group's
    minimum and maximum map to levels 0 and 15."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = (hi - lo).clamp(min=1e-12) / 15.0
    zero = lo + 8.0 * scale
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    scale = scales_and_zeros[..., 0].t().repeat_interleave(group, dim=1)
    zero = scales_and_zeros[..., 1].t().repeat_interleave(group, dim=1)
    return (q.float() - 8.0) * scale + zero


def format_fits(fmt: str, n: int, k: int) -> bool:
    """Whether a [n, k] weight can be held in `fmt` (int4: rows in tiles of 16, groups of 32)."""
    if fmt == "int4":
        return n % INT4_ROW_TILE == 0 and k % INT4_GROUP == 0
    return fmt in FORMATS


class HostWeight:
    """One [N, K] projection of one expert in a CPU format; `mm(x)` is x @ Wᵀ in fp32."""

    def __init__(self, w: torch.Tensor, fmt: str):
        if not format_fits(fmt, *w.shape):
            raise ValueError(f"a {tuple(w.shape)} weight cannot be held as {fmt}")
        self.fmt, self.n, self.k = fmt, w.shape[0], w.shape[1]
        if fmt == "float":
            self.w = w.detach().to("cpu").contiguous()
        elif fmt == "int8":
            self.w, self.scale = int8_rows(w.detach().to("cpu"))
        else:
            q, self.scales_and_zeros = int4_groups(w.detach().to("cpu"))
            self.w = torch._convert_weight_to_int4pack_for_cpu(q, 1)

    @property
    def nbytes(self) -> int:
        extra = {"float": 0, "int8": self.n * 4, "int4": self.k // INT4_GROUP * self.n * 2 * 4}[self.fmt]
        return self.w.numel() * self.w.element_size() + extra

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "float":
            return F.linear(x.to(self.w.dtype), self.w).float()
        if self.fmt == "int8":
            return torch._weight_int8pack_mm(x, self.w, self.scale)
        return torch._weight_int4pack_mm_for_cpu(x, self.w, INT4_GROUP, self.scales_and_zeros)


class HostExperts:
    """One MoE layer's routed experts in host RAM: per expert, gate|up [2I, H] and down [H, I]."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], fmt: str = "float"):
        if fmt not in FORMATS:
            raise ValueError(f"host expert format must be one of {', '.join(FORMATS)}, not {fmt!r}")
        self.fmt = fmt
        self.gate_up = [HostWeight(w, fmt) for w in gate_up]
        self.down = [HostWeight(w, fmt) for w in down]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.gate_up + self.down)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k], weights [T, k] on the CPU -> [T, H] fp32: sum_j weights[t, j] *
        expert_{ids[t, j]}(x[t])."""
        x = x.float()
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        token_of = order // ids.shape[1]
        weight_of = weights.reshape(-1).float()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            rows = token_of[start : start + c]
            h = self.gate_up[e].mm(x.index_select(0, rows))
            gate, up = h.chunk(2, dim=-1)
            y = self.down[e].mm(F.silu(gate) * up)
            out.index_add_(0, rows, y * weight_of[start : start + c, None])
            start += c
        return out

    @classmethod
    def from_stacks(cls, w13: torch.Tensor, w2: torch.Tensor, fmt: str = "float") -> "HostExperts":
        """From stacked float experts: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]."""
        return cls(list(w13.unbind(0)), list(w2.unbind(0)), fmt)
