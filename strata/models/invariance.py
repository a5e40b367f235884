"""What `--batch-invariant` covers, checked on a model as loaded: the engine's on its model, and each
pipeline stage's on its own layers (a stage may hold MoE layers, experts in RAM or quantized experts
that rank 0's layers do not)."""

from __future__ import annotations

import torch

from strata.config import EngineConfig, ModelConfig
from strata.kernels.quant import invariant as k_quant_invariant
from strata.models.moe import MoE
from strata.models.quantize import matmul_qweights_of


def check_batch_invariant(cfg: EngineConfig, mc: ModelConfig, device: torch.device, model: torch.nn.Module) -> None:
    """What --batch-invariant covers: the CPU's torch path for dense and MoE models; on
    CUDA dense and MoE models (the invariant GEMM, grouped-expert GEMM, routing and attention kernels);
    no linear-attention layers. Weights
    kept quantized (`model` as loaded): Q8_0 and FP8 linear weights (`strata.kernels.quant.invariant`),
    no other format and no MoE experts kept quantized (their grouped kernels are not row-invariant)."""
    if not cfg.batch_invariant:
        return
    formats = sorted({q.ggml_type for q in matmul_qweights_of(model) if not k_quant_invariant.supports(q)})
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    quantized_experts = any(m.fp8 is not None or m.quant is not None for m in moes)
    # On CUDA the invariant MoE runs on the stacked experts (`MoE._grouped_invariant`).
    unstacked = device.type == "cuda" and any(m.w13 is None and m.fp8 is None and m.quant is None for m in moes)
    missing = [what for what, lacking in (
        ("MoE layers whose experts are not stacked on CUDA", unstacked),
        (f"{mc.model_type}'s linear-attention layers", mc.is_hybrid),
        (f"weights kept quantized in {', '.join(formats)} (covered: "
         f"{', '.join(k_quant_invariant.FORMATS)}; --no-keep-quantized expands them)", bool(formats)),
        ("MoE experts kept quantized (--keep-quantized, --quantize fp8)", quantized_experts),
        ("MoE experts in host RAM (--cpu-moe, --n-cpu-moe)", any(m.host is not None for m in moes))) if lacking]
    if missing:
        raise ValueError("--batch-invariant is not built yet for " + "; ".join(missing))
