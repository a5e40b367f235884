"""The kernel choices a user may make, held for the whole process.

The engine sets them once at start-up from its `EngineConfig` (`EngineConfig.kernel_choices()`), before
the model is loaded and packed; kernels read `current()` when they launch (or, for the quantized MoE
decode kernels, when a layer is packed). Tests and benchmarks compare arms with `using(...)`.

One value for the process, not per thread: the concurrent read's worker thread and the engine's step
thread launch the same kernels as the thread that made the engine.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

QUANT_DECODE = ("auto", "dequant", "dp4a")
MOE_DECODE = ("fused", "grouped")
LINEAR_ATTENTION_KERNEL = ("auto", "fla", "ref")


@dataclass(frozen=True)
class KernelChoices:
    # The GGUF decode GEMV (M <= 16, 16-bit x) of Q8_0, Q4_K, Q6_K and IQ3_S weights: 'dequant' (weights
    # to 16-bit in registers, tensor cores), 'dp4a' (x quantized per 32 values, packed int8 dot products)
    # or 'auto' (dp4a up to each format's DP4A_MAX_ROWS rows, the dequantizing GEMV above).
    quant_decode: str = "auto"
    # Routed experts kept quantized at decode-sized steps (<= 16 tokens): 'fused' (moe_decode_q's two
    # launches, probed when the layer is packed) or 'grouped' (the sort, grouped GEMMs and combine of moe_q).
    moe_decode: str = "fused"
    # Reads of at least this many rows over GGUF-quantized weights dequantize each weight into one shared
    # 16-bit buffer and run cuBLAS instead of the fused dequantizing GEMMs (0: never).
    dequant_read_rows: int = 512
    # Gated DeltaNet prompt reads on CUDA: 'fla' (fla-core's chunked kernel), 'ref' (torch, chunk by
    # chunk) or 'auto' (fla when fla-core is installed).
    linear_attention_kernel: str = "auto"
    # Programmatic dependent launch on sm_90+ (`strata.kernels.use_pdl`).
    pdl: bool = True
    # CPU steps of few rows through the C kernels of `strata.kernels.cpu_decode` (built with the system C
    # compiler on first use) rather than torch's ops.
    cpu_kernels: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("quant_decode", QUANT_DECODE), ("moe_decode", MOE_DECODE),
                              ("linear_attention_kernel", LINEAR_ATTENTION_KERNEL)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        if isinstance(self.dequant_read_rows, bool) or not isinstance(self.dequant_read_rows, int) \
                or self.dequant_read_rows < 0:
            raise ValueError(f"dequant_read_rows must be an int >= 0 (0: off), not {self.dequant_read_rows!r}")
        for name in ("pdl", "cpu_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, not {getattr(self, name)!r}")


_current = KernelChoices()


def current() -> KernelChoices:
    return _current


def set_choices(choices: KernelChoices) -> None:
    global _current
    if not isinstance(choices, KernelChoices):
        raise TypeError(f"expected KernelChoices, got {type(choices).__name__}")
    _current = choices


@contextmanager
def using(**overrides) -> Iterator[KernelChoices]:
    """The current choices with `overrides` for the block, restored after (whatever the block set)."""
    before = _current
    set_choices(dataclasses.replace(before, **overrides))
    try:
        yield _current
    finally:
        set_choices(before)
