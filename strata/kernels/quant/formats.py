"""The GGUF types kept quantized and the kernel module of each, imported on first use (a CPU-only
install without Triton still loads GGUF files). The format modules' contract is the package's
docstring (`strata.kernels.quant`)."""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = {"Q8_0": "q8_0", "Q4_K": "q4_k", "IQ3_S": "iq3_s", "Q6_K": "q6_k", "IQ4_XS": "iq4_xs", "Q3_K": "q3_k",
            "Q5_K": "q5_k", "Q4_0": "q4_0", "FP8": "fp8"}
# GGUF types kept quantized; FP8 is made at load (`--quantize fp8`)
FORMATS = ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "IQ4_XS", "Q3_K", "Q5_K", "Q4_0")
WRITTEN = ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "Q4_0")  # the formats `writers.quantize` makes from float weights


def format_module(ggml_type: str) -> ModuleType:
    """The kernel module of a GGUF type name (one of FORMATS), or of "FP8" (`--quantize fp8`)."""
    if ggml_type not in _MODULES:
        raise ValueError(f"no quantized kernels for {ggml_type} (kept quantized: {', '.join(FORMATS)})")
    return importlib.import_module(f"strata.kernels.quant.{_MODULES[ggml_type]}")
