"""Quantized weights kept quantized on the device: one module per GGUF format.

Each format module (`q8_0`, `q4_k`, `iq3_s`, `q6_k`, `iq4_xs`, `q3_k`, `q5_k`, `q4_0`) follows one
contract: `GGML_TYPE`, `BLOCK_VALUES`, `BLOCK_BYTES`; `repack(raw)` turns the file's blocks (uint8 [N,
K / BLOCK_VALUES * BLOCK_BYTES], already on the device) into the kernel's planes with device ops only;
`dequantize(planes, n, k)` is the fp32 definition (equal to the gguf package's numpy dequantization,
bit for bit); `matmul(x, planes, n, k)` computes x @ Wᵀ through Triton kernels (a GEMV for
decode-sized M, a tiled GEMM for reads); `random_raw(n, k, seed)` writes valid random blocks for tests
and benchmarks.

`QWeight` binds one tensor's planes to its format and shape; `format_module` maps a GGUF type name to
its module (`formats.py`: imported on first use, so a CPU-only install without Triton still loads GGUF
files).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from strata.kernels import choices
from strata.kernels import device as devices
from strata.kernels.quant.formats import FORMATS, WRITTEN, format_module

__all__ = ["DEQUANT_READ_FORMATS", "FORMATS", "STREAMK_ROWS", "WRITTEN", "QWeight", "QWeightStack", "format_module",
           "random_blocks"]

# Reads whose row count falls here run Q8_0's stream-K GEMM when the weight has a context. On the H200
# it beats the tiled GEMM at 512 rows (1.00-1.49x over the 8B shapes) and loses at 4,096 (0.94-0.98x;
# `python benchmarks/kernels/quant_formats.py --streamk`): the range around the default 512-token
# chunk, to be refined by a sweep between those two points.
STREAMK_ROWS = (256, 1024)
# Formats whose reads may dequantize into a bf16 buffer and run cuBLAS (`QWeight.dequant_buf`).
DEQUANT_READ_FORMATS = ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "IQ4_XS", "Q3_K", "Q5_K", "Q4_0")


@dataclass
class QWeight:
    """One quantized [N, K] weight on its device: the format's planes, built by `repack`."""

    ggml_type: str
    n: int
    k: int
    planes: dict[str, torch.Tensor]
    # The split-K workspace of a format whose decode kernel takes one (`gemv_workspace_numel`), made
    # once here so no call allocates; like the planes, one weight's calls must not run on two streams.
    workspace: torch.Tensor | None = None
    # The read GEMMs' scratch (`streamk.QMatmulContext`), shared by a model's weights (CausalLM.pack
    # sets it on CUDA): with it, Q8_0 reads of STREAMK_ROWS rows run the stream-K GEMM.
    context: object | None = None
    # A bf16/fp16 buffer of >= N*K values shared by a model's weights (CausalLM.pack sets it on CUDA):
    # reads of at least `dequant_read_rows` rows (a kernel choice) dequantize the whole weight into it and
    # run one cuBLAS GEMM, faster than the fused dequantizing GEMMs once the rows amortise the weight's write.
    dequant_buf: torch.Tensor | None = None

    @classmethod
    def from_raw(cls, ggml_type: str, raw: torch.Tensor, n: int, k: int) -> "QWeight":
        mod = format_module(ggml_type)
        if k % mod.BLOCK_VALUES or tuple(raw.shape) != (n, k // mod.BLOCK_VALUES * mod.BLOCK_BYTES):
            raise ValueError(f"{ggml_type} [{n}, {k}]: expected raw blocks of shape "
                             f"({n}, {k // mod.BLOCK_VALUES * mod.BLOCK_BYTES}), got {tuple(raw.shape)}")
        # Configurations, and so workspace sizes, follow the device the weight is on.
        with devices.using(raw.device):
            planes = mod.repack(raw.contiguous())
            # A format whose repack makes its split-K workspace (IQ3_S) hands it over: one place for every
            # format's, which `CausalLM.pack` shares across a model's weights and the read stage twins.
            workspace = planes.pop("workspace", None)
            numel = mod.gemv_workspace_numel(n, k) if hasattr(mod, "gemv_workspace_numel") else 0
        if workspace is None and numel:
            workspace = torch.zeros(numel, dtype=torch.int32, device=raw.device)
        return cls(ggml_type, n, k, planes, workspace)

    def _dequantized_read(self, x: torch.Tensor) -> bool:
        rows = choices.current().dequant_read_rows
        return (self.dequant_buf is not None and rows > 0 and x.dim() == 2 and x.shape[0] >= rows
                and x.dtype == self.dequant_buf.dtype)

    @property
    def module(self) -> ModuleType:
        return format_module(self.ggml_type)

    @property
    def nbytes(self) -> int:
        """The weight's bytes on its device: its planes (the split-K workspace, shared by a packed
        model's weights, is scratch, not weight)."""
        return sum(t.numel() * t.element_size() for t in self.planes.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.planes.values())).device

    def dequantize(self) -> torch.Tensor:
        return self.module.dequantize(self.planes, self.n, self.k)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        from strata.kernels.scratch import scratch

        if self._dequantized_read(x):
            from strata.kernels.quant.dequant import dequantize_into

            w = dequantize_into(self.ggml_type, self.planes, self.n, self.k, scratch(self.dequant_buf))
            return torch.mm(x, w.t(), out=out) if out is not None else torch.mm(x, w.t())
        if (self.context is not None and self.ggml_type == "Q8_0" and x.dim() == 2
                and STREAMK_ROWS[0] <= x.shape[0] <= STREAMK_ROWS[1] and x.dtype != torch.float32):
            from strata.kernels.quant.streamk import q8_0_matmul_streamk

            return q8_0_matmul_streamk(x, self.planes, self.n, self.k, scratch(self.context), out)
        if self.workspace is not None:
            return self.module.matmul(x, self.planes, self.n, self.k, out, workspace=scratch(self.workspace))
        return self.module.matmul(x, self.planes, self.n, self.k, out)

    def silu_mul_matmul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up @ Wᵀ for a SwiGLU MLP's down projection (gate_up [M, 2K]): the format's fused
        form where it has one (FP8: the product quantized straight from gate|up), else the two steps."""
        from strata.kernels.activation import silu_mul
        from strata.kernels.scratch import scratch

        fused = getattr(self.module, "silu_mul_matmul", None)
        if fused is None or self._dequantized_read(gate_up):
            return self.matmul(silu_mul(gate_up))
        return fused(gate_up, self.planes, self.n, self.k,
                     workspace=scratch(self.workspace) if self.workspace is not None else None)


@dataclass
class QWeightStack:
    """Projections applied as one stack whose kept-quantized weights differ in format: a Q4_K_M file
    keeps attn_v in Q6_K in some layers beside Q4_K q and k. Each part runs its own kernels into its
    columns of one [M, sum N] output (the kernels take an output row stride), so the stack stays
    quantized instead of being expanded to floats."""

    parts: tuple[QWeight, ...]

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def ggml_type(self) -> str:
        return "+".join(p.ggml_type for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = out if out is not None else x.new_empty(x.shape[0], self.n)
        c = 0
        for p in self.parts:
            p.matmul(x, y[:, c : c + p.n])
            c += p.n
        return y


# Byte offsets of each block's fp16 scale fields (d; Q4_K also dmin), which `random_blocks` must keep
# finite; every other byte of a block is valid whatever its value.
_SCALE_FIELDS = {"Q8_0": (0,), "Q4_K": (0, 2), "IQ3_S": (0,), "Q6_K": (208,), "IQ4_XS": (0,), "Q3_K": (108,),
                 "Q5_K": (0, 2), "Q4_0": (0,)}
# Q6_K multiplies d by an int8 scale and q − 32 (RMS ~74 and ~18 for random bytes): a smaller d. IQ4_XS
# by a scale − 32 and a table value (~18 and ~66), Q3_K by a scale − 32 and u − 4 (~18 and ~2.3); Q5_K
# has twice Q4_K's quant range: half its d; Q4_0 multiplies d by q − 8 alone (~4.6): a larger d.
_SCALE_RANGE = {"Q6_K": (1e-5, 2e-5), "IQ4_XS": (1e-5, 2e-5), "Q3_K": (3e-4, 6e-4), "Q5_K": (5e-5, 1.5e-4),
                "Q4_0": (2e-3, 6e-3)}


def random_blocks(ggml_type: str, n: int, k: int, generator: torch.Generator, device) -> torch.Tensor:
    """Random but valid raw blocks [N, K / BLOCK_VALUES * BLOCK_BYTES] made on the device (benchmarks
    at 8B shapes: the modules' `random_raw` writers are numpy and meant for test sizes). Scales are
    ~2e-4, so values land near the ±0.02 of the float random weights."""
    mod = format_module(ggml_type)
    blocks = k // mod.BLOCK_VALUES
    raw = torch.randint(0, 256, (n, blocks, mod.BLOCK_BYTES), generator=generator, device=device, dtype=torch.uint8)
    low, high = _SCALE_RANGE.get(ggml_type, (1e-4, 3e-4))
    for off in _SCALE_FIELDS[ggml_type]:
        scale = torch.empty(n, blocks, 1, device=device, dtype=torch.float16).uniform_(low, high, generator=generator)
        raw[:, :, off : off + 2] = scale.view(torch.uint8)
    return raw.view(n, blocks * mod.BLOCK_BYTES)

