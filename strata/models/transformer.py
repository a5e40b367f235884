"""The decoder-only causal LM that qwen3, qwen3_moe and glm4_moe share.

The architectures differ in configuration (qk-norm, partial rotary, MoE routing, shared experts,
biases), which `layers.py` reads from `ModelConfig`, and in whether the checkpoint carries MTP layers
(`mtp.py`). `forward` returns the final, normed hidden states; `compute_logits` applies the head, so
a caller that needs logits only at some rows (the last token of each sequence) pays only for those.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.config import ModelConfig
from strata.attention import AttentionBackend
from strata.kernels import device as devices
from strata.kernels import triton_available
from strata.kernels.gemv import gemv_supported, gemv_workspace_parts
from strata.kernels.matmul import invariant_workspace_parts
from strata.kernels.splitk import shared_split_k_numel
from strata.kernels.quant import QWeight
from strata.kernels.quant.invariant import invariant_q_workspace_parts
from strata.kernels.quant.invariant import supports as supports_invariant_q
from strata.models.decoder import CPU_PLAN_ROWS, DecoderLayer, cpu_kernels, cpu_product
from strata.models.layers import QuantizedEmbedding, RMSNorm, RopeInputs, Rotary, linear, take_quantized
from strata.models.mtp import MTPLayer
from strata.models.quantize import matmul_qweights_of


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool, layer_cls: type = DecoderLayer, norm_cls: type = RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [layer_cls(cfg, i) for i in range(cfg.num_hidden_layers)]
        if with_mtp:
            # MTP layers sit after the decoder layers, as GLM-4.5 / DeepSeek-V3 checkpoints store them.
            n = cfg.num_hidden_layers
            layers += [MTPLayer(cfg, n + j) for j in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    decoder_layer: type = DecoderLayer  # an architecture's block and final norm, when not the common ones
    final_norm: type = RMSNorm
    mtp_checkpoint_prefix: str | None = None  # where the checkpoint keeps MTP tensors: None, after the layers

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.model = DecoderModel(cfg, with_mtp, self.decoder_layer, self.final_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.gemv_ws: torch.Tensor | None = None  # set by pack() on CUDA: the GEMV kernels' workspace
        self.lm_head_q: QWeight | None = None  # the LM head kept quantized (loader + pack)
        self.cpu_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # few-row CPU logits (pack)
        self.batch_invariant = False  # set_batch_invariant

    def set_batch_invariant(self, on: bool) -> None:
        """`--batch-invariant`: every module that multiplies rows by a weight computes each row alone
        (`strata.kernels.invariant`; float weights, and Q8_0 / FP8 ones kept quantized:
        `strata.kernels.quant.invariant`; the engine refuses what it does not cover)."""
        for m in self.modules():
            if hasattr(m, "batch_invariant"):
                m.batch_invariant = on

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.model.layers[self.num_layers :])

    @property
    def num_attention_layers(self) -> int:
        """Layers that need a K/V cache, MTP layers included (a pipeline stage's: those it holds)."""
        return sum(not getattr(m, "held_elsewhere", False) for m in self.model.layers)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        return RopeInputs(positions, self.rotary, dtype)

    @torch.no_grad()
    def pack(self) -> None:
        """Stack q|k|v and gate|up projections (and MoE experts) for fewer, larger GEMMs; on the CPU, also
        build the few-row steps' plans (`CpuDecodePlan`) and LM head product from the weights as they are
        now. Call once the weights are on their final device and dtype, with their final values: moving
        the module afterwards copies views apart, and the CPU plans hold copies."""
        from strata.models.layers import MLP, Attention
        from strata.models.moe import MoE

        expert_mlps = {id(e) for m in self.modules() if isinstance(m, MoE) for e in m.experts}
        dtype = self.model.embed_tokens.weight.dtype
        self.lm_head_q = take_quantized([self.lm_head], dtype)
        embed = self.model.embed_tokens
        if self.lm_head_q is None and isinstance(embed, QuantizedEmbedding) and self.lm_head.weight is embed.weight:
            self.lm_head_q = embed.q  # tied to a table kept quantized: one copy of the blocks serves both
        packed = []
        for m in self.modules():
            if isinstance(m, Attention) or (isinstance(m, MLP) and id(m) not in expert_mlps):
                m.pack(dtype)
                packed.append(m)
            elif isinstance(m, MoE):
                m.pack_experts()
            elif not isinstance(m, MLP) and callable(getattr(m, "gemv_weights", None)):
                # Another architecture's layer, packed by its model (MoE experts' MLPs stay out).
                packed.append(m)
        on_cpu = self.model.embed_tokens.weight.device.type == "cpu"
        kernels = cpu_kernels() if on_cpu else None
        for m in self.modules():
            if isinstance(m, DecoderLayer):
                m.plan_cpu(kernels)
        self.cpu_head = None
        head = self.lm_head.weight
        if on_cpu and self.lm_head_q is None and head.dtype == torch.float32 and not head.is_meta and head.numel():
            self.cpu_head = cpu_product(kernels, head)
        head = self.lm_head.weight
        if self.model.embed_tokens.weight.is_cuda and triton_available():
            # One split-K workspace serves every GEMV of the model: the launches run one after another
            # and each leaves its counters at zero; sized so no shape's partials overlap another's
            # counters (`shared_split_k_numel`).
            # A later pipeline stage's head is an empty placeholder (`strata.models.held`): no shape of its own.
            shapes = [tuple(head.shape)] if head.numel() else []
            shapes += [tuple(t.shape) for m in packed for t in m.gemv_weights() if t is not None]
            shapes += [tuple(m.shared_head.head.weight.shape) for m in self.modules()
                       if getattr(getattr(m, "shared_head", None), "head", None) is not None]
            # The batch-invariant GEMM's decode-sized launches take their split ranges' partials there too.
            # Configurations, and so the sizes, are the model's device's (`strata.kernels.device`).
            with devices.using(self.model.embed_tokens.weight.device):
                parts = [gemv_workspace_parts(n, k) for n, k in shapes if gemv_supported(1, n, k, dtype)]
                parts += [invariant_workspace_parts(n, k) for n, k in shapes]
                # Kept-quantized projections (and a stack's parts) launch with shapes `shapes` does not list.
                parts += [invariant_q_workspace_parts(q) for q in matmul_qweights_of(self) if supports_invariant_q(q)]
            numel = shared_split_k_numel(parts)
            self.gemv_ws = torch.zeros(max(numel, 1), dtype=torch.int32, device=self.model.embed_tokens.weight.device)
            for m in packed:
                m.gemv_ws = self.gemv_ws
            self._share_read_context()
            self._share_dequant_buffer(dtype)
            self._share_quant_workspace()

    def _share_dequant_buffer(self, dtype: torch.dtype) -> None:
        """One buffer the size of the largest quantized weight, in the model dtype, for every weight's
        dequantized reads (`QWeight.dequant_buf`); a read's layers run one after another on one stream."""
        from strata.kernels.quant import DEQUANT_READ_FORMATS

        # Not the LM head: it sees sampling rows only, never a read's, and would make the buffer six
        # times larger (152K x 4096 at the 8B shape).
        weights = [q for q in matmul_qweights_of(self) if q.ggml_type in DEQUANT_READ_FORMATS and q is not self.lm_head_q]
        if not weights or dtype not in (torch.bfloat16, torch.float16):
            return
        buf = torch.empty(max(q.n * q.k for q in weights), dtype=dtype, device=weights[0].device)
        for q in weights:
            q.dequant_buf = buf

    def _share_quant_workspace(self) -> None:
        """One split-K workspace for every quantized weight's decode kernels instead of one each (at the
        8B shape ~10 MiB a layer, 360 MiB in all, once the dp4a and dequantizing GEMVs both split K).
        Each kernel keeps its counters at the start of a workspace and its partials at its end
        (`strata.kernels.splitk`); twice the largest weight's own size leaves every weight's partials
        clear of every weight's counters, which each launch leaves at zero. Launches run one after
        another on a stream, as the model's bf16 GEMVs share `gemv_ws`."""
        weights = [q for q in matmul_qweights_of(self) if q.workspace is not None]
        if len(weights) < 2:
            return
        shared = torch.zeros(2 * max(q.workspace.numel() for q in weights), dtype=torch.int32,
                             device=weights[0].device)
        for q in weights:
            q.workspace = shared

    def _share_read_context(self) -> None:
        """One stream-K scratch context for the model's Q8_0 weights, its largest fix-up reserved now so
        no read allocates (`QMatmulContext.reserve_fixup`)."""
        from strata.kernels.quant.streamk import QMatmulContext

        weights = [q for q in matmul_qweights_of(self) if q.ggml_type == "Q8_0"]
        if not weights:
            return
        device = weights[0].device
        ctx = QMatmulContext(device)
        ctx.reserve_fixup(QMatmulContext.largest_fixup(devices.current(device).sm_count))
        for q in weights:
            q.context = ctx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [N] → final hidden states [N, hidden] (after the final norm)."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rope(positions, x.dtype)
        residual = None
        for layer in self.model.layers[: self.num_layers]:
            x, residual = layer.forward_fused(x, residual, rope, attn)
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.cpu_head
        if (head is not None and hidden.shape[0] <= CPU_PLAN_ROWS and hidden.dtype == torch.float32
                and not self.batch_invariant and not torch.is_grad_enabled() and hidden.device.type == "cpu"
                and not self.lm_head.weight.requires_grad):
            return head(hidden)
        return linear(hidden, self.head_weight, None, self.gemv_ws, self.batch_invariant).float()

    @property
    def head_weight(self) -> "torch.Tensor | QWeight":
        return self.lm_head_q if self.lm_head_q is not None else self.lm_head.weight

    def mtp_forward(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, depth: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step. Row i combines the main model's hidden state at position i with the token at
        position i+1 and predicts the token at i+2. Returns (mtp hidden [N, H], logits [N, V] fp32)."""
        h = self.mtp_hidden(hidden, next_ids, positions, attn, depth)
        return h, self.mtp_logits(h, depth)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                   depth: int = 0) -> torch.Tensor:
        """The MTP layer's output hidden states [N, H] (its K/V written), without logits."""
        layer = self.model.layers[self.num_layers + depth]
        return layer(hidden, next_ids, self.rope(positions, hidden.dtype), attn, self.model.embed_tokens)

    def mtp_logits(self, h: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """fp32 logits [N, V] of MTP hidden states: a drafter asks only for the rows it draws from."""
        return self.model.layers[self.num_layers + depth].logits(h, self.head_weight, self.gemv_ws)
