"""Passes over a loaded model's modules for its quantized weights: finding them (`qweights_of`), making
FP8 ones at load (`quantize_fp8`, `--quantize fp8`), and listing the kernel scratch its weights and
layers share (`model_scratch`), which a second stage twins (`strata.kernels.scratch`)."""

from __future__ import annotations

import torch

from strata.kernels.quant import QWeight, QWeightStack
from strata.kernels.quant import fp8 as fp8_format
from strata.kernels.quant import moe_decode_q
from strata.models.layers import MLP, Attention, QuantizedEmbedding
from strata.models.moe import MoE


def qweights_of(model: torch.nn.Module) -> list[QWeight]:
    """Every `QWeight` held by a model's modules (the parts of a `QWeightStack` included), each once."""
    found: dict[int, QWeight] = {}
    for m in model.modules():
        for value in vars(m).values():
            for q in value.parts if isinstance(value, QWeightStack) else (value,):
                if isinstance(q, QWeight):
                    found[id(q)] = q
    return list(found.values())


def matmul_qweights_of(model: torch.nn.Module) -> list[QWeight]:
    """`qweights_of` less the embedding tables kept quantized (`QuantizedEmbedding`: looked up, never
    multiplied by) that no LM head reads: what the matmul kernels' shared scratch and modes concern."""
    head = getattr(model, "lm_head_q", None)
    tables = {id(m.q) for m in model.modules() if isinstance(m, QuantizedEmbedding) and m.q is not head}
    return [q for q in qweights_of(model) if id(q) not in tables]


def model_scratch(model: torch.nn.Module) -> list[object]:
    """Every shared scratch object of a model (tensors and stream-K contexts), each once."""
    found: dict[int, object] = {}
    for m in model.modules():
        for name, value in list(vars(m).items()) + list(m._buffers.items()):
            if name in ("gemv_ws", "sort_ws", "route_ws") and isinstance(value, torch.Tensor):
                found[id(value)] = value
    for q in qweights_of(model):
        for x in (q.workspace, q.context, q.dequant_buf):
            if x is not None:
                found[id(x)] = x
    return list(found.values())


def quantize_fp8(model: torch.nn.Module) -> int:
    """`--quantize fp8`: the attention and dense-MLP projections of a loaded, packed model become FP8
    `QWeight`s and its MoE experts' stacked weights e4m3 (a scale per output channel; routers, norms,
    embeddings and the LM head stay as they are). Their float weights are dropped (left on the meta
    device). Returns the weights (stacks) converted."""
    experts = {id(e) for m in model.modules() if isinstance(m, MoE) for e in m.experts}
    done = 0

    def fp8(w: torch.Tensor) -> QWeight:
        return QWeight.from_raw("FP8", w.detach(), w.shape[0], w.shape[1])

    def drop(*linears: torch.nn.Module) -> None:
        for lin in linears:
            lin.weight = torch.nn.Parameter(torch.empty(lin.weight.shape, device="meta", dtype=lin.weight.dtype),
                                            requires_grad=False)

    for m in model.modules():
        if isinstance(m, Attention) and m.qkv_weight is not None:
            m.qkv_q, m.o_q = fp8(m.qkv_weight), fp8(m.o_proj.weight)
            m.qkv_weight = None
            drop(m.q_proj, m.k_proj, m.v_proj, m.o_proj)
            done += 2
        elif isinstance(m, MLP) and id(m) not in experts and m.gate_up_weight is not None:
            m.gate_up_q, m.down_q = fp8(m.gate_up_weight), fp8(m.down_proj.weight)
            m.gate_up_weight = None
            drop(m.gate_proj, m.up_proj, m.down_proj)
            done += 2
        elif isinstance(m, MoE) and m.w13 is not None:
            dtype = m.w13.dtype
            m.fp8 = (*fp8_format.quantize_experts(m.w13), *fp8_format.quantize_experts(m.w2))
            m.w13 = m.w2 = m.w13_ext = m.w2_ext = None
            m.decode_kernel = False
            m.qdecode = moe_decode_q.decode_stacks(moe_decode_q.Fp8Experts(*m.fp8[:2]),
                                                   moe_decode_q.Fp8Experts(*m.fp8[2:]), m.num_experts_per_tok, dtype)
            drop(*(lin for e in m.experts for lin in (e.gate_proj, e.up_proj, e.down_proj)))
            done += 2
    return done
