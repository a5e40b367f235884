"""Frozen configuration objects.

`ModelConfig` is what a model file says about itself (read from an HF `config.json` or from GGUF
metadata turned into the same dict). `EngineConfig` is how the user wants it run; CLI defaults are
read from its field defaults so there is one source of truth.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata.kernels.choices import KernelChoices


class ConfigError(ValueError):
    """A model configuration that Strata cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`.
        params = dict(d.get("rope_scaling") or {})
        params.update(d.get("rope_parameters") or {})
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "yarn"):
            raise ConfigError(f"unsupported rope type {kind!r}")
        orig = params.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
        if kind == "yarn" and orig is None:
            orig = d.get("max_position_embeddings")
        return cls(
            theta=float(theta),
            kind=kind,
            factor=float(params.get("factor") or 1.0),
            original_max_position=orig,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


def _layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """qwen3_next's layer kinds: `layer_types` as stored, else every `full_attention_interval`-th
    layer full attention (HF's default of 4), the others linear."""
    if d.get("layer_types"):
        kinds = tuple(d["layer_types"])
        # transformers 5 writes an all-"full_attention" list for plain models (and sliding-window kinds):
        # only a list with linear layers describes a hybrid.
        return kinds if "linear_attention" in kinds else ()
    if d.get("model_type") != "qwen3_next":
        return ()
    every = int(d.get("full_attention_interval") or 4)
    return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(int(d["num_hidden_layers"])))


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_qk_norm: bool = False
    # MoE. num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    norm_topk_prob: bool = False
    scoring: str = "softmax"  # softmax | sigmoid (sigmoid carries an e_score_correction_bias)
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Multi-token prediction layers stored after the decoder layers (DeepSeek-V3 / GLM-4.5 layout).
    num_nextn_predict_layers: int = 0
    # Hybrid models (qwen3_next): per layer "full_attention" or "linear_attention" (Gated DeltaNet);
    # empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_intermediate_size: int = 0  # qwen3_next's one gated shared expert
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_linear(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention: their per-sequence state replaces a K/V cache."""
        return any(self.layer_is_linear(i) for i in range(self.num_hidden_layers))

    @property
    def num_full_attention_layers(self) -> int:
        return sum(not self.layer_is_linear(i) for i in range(self.num_hidden_layers))

    def layer_is_moe(self, i: int) -> bool:
        if not self.is_moe or i in self.mlp_only_layers or i < self.first_k_dense_replace:
            return False
        return (i + 1) % max(self.decoder_sparse_step, 1) == 0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF `config.json` (either transformers 4.x or 5.x spelling)."""
        try:
            mt = d["model_type"]
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            num_experts = int(d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts") or 0)
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            rope_params = d.get("rope_parameters") or {}
            partial = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
            return cls(
                model_type=mt,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d.get("intermediate_size") or 0),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                rope=RopeConfig.from_hf(d),
                partial_rotary_factor=float(partial),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                # qwen3 always normalises q/k per head; glm4_moe says so in `use_qk_norm`.
                use_qk_norm=bool(d.get("use_qk_norm", mt in ("qwen3", "qwen3_moe", "qwen3_next"))),
                num_experts=num_experts,
                num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
                n_shared_experts=int(d.get("n_shared_experts") or 0),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                scoring="sigmoid" if mt == "glm4_moe" else "softmax",
                routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
                n_group=int(d.get("n_group") or 1),
                topk_group=int(d.get("topk_group") or 1),
                first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
                decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or d.get("mtp_num_hidden_layers") or 0),
                layer_types=_layer_types(d),
                linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim") or 4),
                linear_key_head_dim=int(d.get("linear_key_head_dim") or 0),
                linear_value_head_dim=int(d.get("linear_value_head_dim") or 0),
                linear_num_key_heads=int(d.get("linear_num_key_heads") or 0),
                linear_num_value_heads=int(d.get("linear_num_value_heads") or 0),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required key {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf(json.load(f))

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_buckets(max_seqs: int) -> list[int]:
    """The batch sizes CUDA graphs are captured for (the runner's and the MTP drafter's), largest first:
    the buckets below `max_seqs`, and it."""
    return sorted({b for b in GRAPH_BUCKETS if b < max_seqs} | {max_seqs}, reverse=True)


@dataclass(frozen=True)
class EngineConfig:
    """How a model is run. Every CLI flag of `strata generate/serve` defaults to a field here."""

    model: str | None = None  # None: the embedded default model
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    ctx: int = 4096  # maximum tokens per sequence (prompt + output)
    seed: int | None = None  # seeds requests that bring none (in arrival order): reproducible runs
    parallel: int = 1  # slots: requests decoding at once; more wait in a queue
    kv: str = "auto"  # KV cache storage: auto (the model dtype) | bf16 | int8
    # A GGUF file's quantized linear weights and MoE experts stay quantized on the device (their Triton
    # kernels, docs/QUANTIZATION.md) instead of being expanded to the model dtype at load. None: on for
    # CUDA (the file's size, not bf16's), off on the CPU and with --batch-invariant or --quantize.
    keep_quantized: bool | None = None
    # Quantize an HF checkpoint's attention and MLP projections (MoE experts too) at load: None or "fp8"
    # (e4m3, a scale per output channel; decode rows weight-only through the GEMV, reads through
    # torch._scaled_mm with activations quantized per token).
    quantize: str | None = None
    kv_size: int | None = None  # KV capacity in tokens; None: from free memory (CUDA), ctx x parallel (CPU)
    gpu_memory_utilization: float = 0.9  # share of the GPU's free memory the KV pool may take
    # Tokens of each slot's most recent K/V kept in the device pool; older full blocks move to a host pool
    # (same layout and storage) and attention reads both tiers. None: every token stays on the device.
    kv_resident: int | None = None
    # GiB of host RAM for the host KV pool (allocated at start-up): the tier's blocks and the prefix cache's
    # blocks kept in RAM. None: with --kv-resident, the contexts that do not fit the window (ctx x parallel).
    kv_host_memory: float | None = None
    # With --kv-resident on CUDA, decode steps with a host part replay CUDA graphs cut at each attention
    # layer, the host part attended on the CPU between the pieces (off: those steps launch eagerly)
    kv_tier_graphs: bool = False
    # Where a decode row attends its host KV part: cpu (the C kernel reads the host pool in place, split
    # over the threads) | stream (each layer's host blocks copied to the GPU, as prompt chunks do, and the
    # paged attention kernel) | pcie (the paged attention kernel reads the pinned host pool in place over
    # PCIe, its keys split over many programs) | auto (on CUDA whichever one layer measured fastest at
    # start-up; else cpu). Streamed decode steps launch eagerly; PCIe ones replay graphs of their own.
    kv_tier_decode: str = "auto"
    block_size: int = 16  # tokens per KV block
    chunk_size: int | None = None  # most prompt tokens one request reads per step; None: 2048 on CUDA, 512 on CPU
    max_num_batched_tokens: int | None = None  # per-step token budget (reads + decodes); None: chunk + every slot's decode rows, at least 2048
    give_way: bool = True  # a long prompt read yields to newer requests at chunk boundaries
    max_hold_steps: int = 16  # but a long read held this many steps in a row reads a chunk anyway
    prefix_cache: bool = True  # reuse the K/V of full blocks of earlier requests with the same prefix
    spec: int = 0  # MTP speculation: up to N drafts per step (0 = off)
    spec_min_p: float = 0.0  # stop drafting at the first draft whose MTP probability is below this
    spec_adaptive: bool = False  # each slot's draft count follows its running acceptance (1..N)
    batch_mtp: bool = False  # run all slots' MTP drafts as one batch (else one slot at a time)
    batch_groups: int = 1  # slots split into G decode groups stepped in turn (slot % G)
    overlap: bool = True  # with G > 1: launch a group's step before finishing the previous group's
    cuda_graph: bool = True  # replay CUDA graphs for decode and verification steps (CUDA only)
    # A short read beside decoding slots gets a step of its own, one prompt-chunk graph replay, instead of
    # an eager step shared with the decodes (CUDA with graphs; they wait that one step).
    solo_reads: bool = True
    # A request's logits do not depend on what else the engine runs (batch, chunking, prefix-cache hits,
    # speculation): every row is computed alone. Opt-in for its measured cost (docs/DETERMINISM.md).
    batch_invariant: bool = False
    # Queue each step before reading the previous one's tokens (decode inputs taken on the device), so
    # the GPU never waits for the host; needs --spec 0 and one batch group. None: on for CUDA.
    async_scheduling: bool | None = None
    # With the concurrent read (STRATA_PIPED_CONCURRENT): fail a read step during which the stage's upload
    # ring or stream-K pool, the KV pool or torch's caching allocator grew (a check of the no-allocation rule).
    alloc_guard: bool = False
    # GGUF decode GEMV (M <= 16): auto | dequant | dp4a; auto: dp4a up to the rows where each format measured it faster
    quant_decode: str = "auto"
    # Kept-quantized MoE experts at decode steps: fused | grouped; fused: two launches for the grouped path's twelve
    moe_decode: str = "fused"
    # Reads of >= this many rows dequantize GGUF weights to 16 bits for cuBLAS (0 = off): H200 1.5-5x at 512-4,096 rows
    dequant_read_rows: int = 512
    # Gated DeltaNet prompt reads on CUDA: auto | fla | ref; auto: fla-core's kernel (5.5x the reference) if installed
    linear_attention_kernel: str = "auto"
    # Programmatic dependent launch on sm_90+: each Triton kernel's launch overlaps its predecessor's tail
    pdl: bool = True
    # CPU decode steps and the host KV tier's decode rows through Strata's C kernels (compiled with the
    # system C compiler on first use; the same tokens, sums in another order); off: torch's ops
    cpu_kernels: bool = True
    # GiB of GPU memory Strata may place (weights, KV, scratch, graphs); None: the card's free memory
    # x gpu_memory_utilization. The memory plan fits everything in it and torch's allocator is capped to it.
    gpu_memory: float | None = None
    cpu_moe: bool = False  # every MoE layer's routed experts in host RAM, computed on the CPU
    n_cpu_moe: int | None = None  # the first N MoE layers' routed experts in host RAM; None: as the memory plan fits
    # The CPU format of routed experts in RAM: float (the model dtype, exact) | int8 (a scale per row) | w8a8
    # (int8 weights and activations, a scale per token, oneDNN) | fbgemm (int8 weights, uint8 activations,
    # FBGEMM) | compiled (int8 rows; a step's layer in one kernel torch.compile generates) | compiled-int4
    # (4-bit levels in groups of 32, an fp32 scale and offset each; the same generated kernel) | int4 (groups
    # of 32, torch's int4 kernel) | file (no CPU copy: RAM holds only the GPU's format, the file's blocks,
    # which the GPU reads over PCIe for decode rows and streams for larger steps; CUDA only) | auto (float
    # for float weights; with a C++ compiler compiled-int4 for IQ3_S, Q4_K and Q4_0 experts, whose groups it
    # holds exactly, and compiled for others; without one fbgemm where torch has it, else w8a8; when host
    # RAM cannot hold an int8 copy, compiled-int4, else int4; on CUDA, file when it cannot hold a 4-bit one)
    host_experts: str = "auto"
    # Where decode steps compute the routed experts held in RAM: cpu (the host format above, on the CPU,
    # the step waiting for it between layers) | pcie (the GPU's fused decode kernels read the chosen
    # experts' rows straight from the pinned copy kept for streaming, over PCIe: no wait for the host, one
    # CUDA graph a step) | both (of each row's chosen experts, the CPU computes the first few while the GPU
    # reads the others over PCIe, the count one layer's step measured fastest at start-up) | auto (on CUDA
    # the fastest of all counts, none to every one, at start-up; else cpu).
    host_expert_decode: str = "auto"
    # Steps of this many tokens or more bring the routed experts held in RAM to the GPU (pinned, two layers
    # deep, on a side stream) and compute them there; fewer: on the CPU. 0: always the CPU. None: measured
    # at start-up, the step size at which a layer's CPU time passes its copy over PCIe.
    expert_stream_tokens: int | None = None
    # With experts in RAM on CUDA, decode steps replay CUDA graphs in pieces, one between each two layers
    # whose experts the CPU computes (off: those steps launch every kernel eagerly, 4.5x slower on the
    # 80B-A3B under 16 GiB)
    host_expert_graphs: bool = True
    # Pipeline stages over torch.distributed (docs/MULTI_GPU.md): none | layer. With layer, one process per
    # stage holds a range of decoder layers (their weights and K/V); rank 0 also runs the scheduler, the
    # embedding, the head and sampling, and starts the other stages of this machine itself; the last stage
    # runs the MTP head. With --batch-groups G the groups' steps are in the pipeline together.
    split_mode: str = "none"
    # With --split-mode layer: each stage's share of the decoder layers, e.g. "3,2"; None: even over the stages
    # (the count of --devices, else every GPU of the machine). On the CPU it names the stages: "1,1" runs two.
    tensor_split: str | None = None
    # The GPUs of this machine's stages, in stage order, e.g. "0,1" (indices or cuda:N); None: all of them.
    devices: str | None = None
    # HOST:PORT of rank 0 when stages span machines started without torchrun (each runs the same command
    # with its --node-rank); None: one machine, or torchrun's own rendezvous.
    dist_init_addr: str | None = None
    nnodes: int = 1  # machines the stages span (each runs the same number of stages)
    node_rank: int = 0  # this machine's index among --nnodes (0 runs the scheduler and the server)

    def __post_init__(self) -> None:
        if self.kv not in ("auto", "bf16", "int8"):
            raise ValueError(f"kv must be auto, bf16 or int8, not {self.kv!r}")
        if self.quantize not in (None, "fp8"):
            raise ValueError(f"quantize must be fp8 (or unset), not {self.quantize!r}")
        for name in ("ctx", "parallel", "block_size", "chunk_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 1 <= self.batch_groups <= self.parallel:
            raise ValueError("batch_groups must be within 1..parallel")
        if self.spec < 0 or not 0.0 <= self.spec_min_p <= 1.0:
            raise ValueError("spec must be >= 0 and spec_min_p within [0, 1]")
        if self.async_scheduling and (self.spec or self.batch_groups > 1):
            raise ValueError("async_scheduling needs spec 0 and batch_groups 1 (drafts and groups need each "
                             "step's tokens on the host before the next step)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.parallel:
            raise ValueError("max_num_batched_tokens must be >= parallel (one decode token per slot)")
        for name, allowed in (("quant_decode", ("auto", "dequant", "dp4a")), ("moe_decode", ("fused", "grouped")),
                              ("linear_attention_kernel", ("auto", "fla", "ref"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        if self.dequant_read_rows < 0:
            raise ValueError("dequant_read_rows must be >= 0 (0 = off)")
        if self.gpu_memory is not None and self.gpu_memory <= 0:
            raise ValueError("gpu_memory must be > 0 (GiB)")
        if self.kv_resident is not None and self.kv_resident < self.block_size:
            raise ValueError(f"kv_resident must be at least one block ({self.block_size} tokens)")
        if self.kv_host_memory is not None and self.kv_host_memory <= 0:
            raise ValueError("kv_host_memory must be > 0 (GiB)")
        if self.n_cpu_moe is not None and (self.n_cpu_moe < 0 or self.cpu_moe):
            raise ValueError("n_cpu_moe must be >= 0, and not given with cpu_moe")
        if self.kv_tier_decode not in ("auto", "cpu", "stream", "pcie"):
            raise ValueError(f"kv_tier_decode must be auto, cpu, stream or pcie, not {self.kv_tier_decode!r}")
        if self.host_expert_decode not in ("auto", "cpu", "pcie", "both"):
            raise ValueError(f"host_expert_decode must be auto, cpu, pcie or both, not {self.host_expert_decode!r}")
        if self.host_experts not in ("auto", "float", "int8", "w8a8", "fbgemm", "compiled", "compiled-int4", "int4",
                                     "file"):
            raise ValueError(f"host_experts must be auto, float, int8, w8a8, fbgemm, compiled, compiled-int4, int4 "
                             f"or file, not {self.host_experts!r}")
        if self.host_experts == "file" and self.device == "cpu":
            raise ValueError("host_experts file keeps the experts in RAM for the GPU alone: it needs CUDA")
        if self.host_experts == "file" and self.host_expert_decode in ("cpu", "both"):
            raise ValueError(f"host_expert_decode {self.host_expert_decode} computes experts on the CPU: host_experts "
                             "file keeps no CPU copy of them (decode reads them over PCIe)")
        if self.expert_stream_tokens is not None and self.expert_stream_tokens < 0:
            raise ValueError("expert_stream_tokens must be >= 0")
        if self.split_mode not in ("none", "layer"):
            raise ValueError(f"split_mode must be none or layer, not {self.split_mode!r}")
        if self.split_mode == "none" and (self.tensor_split or self.dist_init_addr or self.nnodes != 1):
            raise ValueError("tensor_split, dist_init_addr and nnodes need split_mode layer")
        if self.tensor_split is not None:
            try:
                shares = [float(x) for x in self.tensor_split.split(",")]
            except ValueError:
                raise ValueError(f"tensor_split must be comma-separated numbers, not {self.tensor_split!r}") from None
            if not shares or any(not x > 0 for x in shares):
                raise ValueError(f"tensor_split must be positive shares, not {self.tensor_split!r}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("nnodes must be >= 1 and node_rank within 0..nnodes-1")

    def kernel_choices(self) -> KernelChoices:
        """The kernel choices this config asks for (`strata.kernels.choices.KernelChoices`: one set per
        process, which `LLMEngine` installs when it starts)."""
        from strata.kernels.choices import KernelChoices

        return KernelChoices(quant_decode=self.quant_decode, moe_decode=self.moe_decode,
                             dequant_read_rows=self.dequant_read_rows,
                             linear_attention_kernel=self.linear_attention_kernel, pdl=self.pdl,
                             cpu_kernels=self.cpu_kernels)

    def resolved(self) -> "EngineConfig":
        """This config with the device-dependent defaults filled in. The GPU read chunk was chosen by
        measurement (docs/PERFORMANCE.md): on the H200 a 32K read in chunks of 2048 runs at 0.94x of
        one 8192-token chunk, in chunks of 512 at 0.75x; the CPU keeps small chunks, which give way sooner."""
        chunk = self.chunk_size or (2048 if self.resolved_device.startswith("cuda") else 512)
        budget = self.max_num_batched_tokens or max(2048, chunk + self.parallel * (1 + self.spec))
        async_ = self.async_scheduling
        if async_ is None:
            async_ = self.resolved_device.startswith("cuda") and not self.spec and self.batch_groups == 1
        keep = self.keep_quantized
        if keep is None:
            keep = self.resolved_device.startswith("cuda") and not self.batch_invariant and self.quantize is None
        return dataclasses.replace(self, chunk_size=chunk, max_num_batched_tokens=budget, async_scheduling=async_,
                                   keep_quantized=keep)

    @property
    def resolved_device(self) -> str:
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype:
            return self.dtype
        return "bfloat16" if self.resolved_device.startswith("cuda") else "float32"

    @property
    def torch_dtype(self):
        import torch

        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.resolved_dtype not in names:
            raise ValueError(f"unknown dtype {self.resolved_dtype!r} (choose from {', '.join(names)})")
        return names[self.resolved_dtype]

    def replace(self, **kw: Any) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
