"""Model loading: read a checkpoint (HF directory or GGUF file), build the model on the meta device,
check every tensor's name and shape against it, and assign the weights on the target device.

With `keep_quantized`, a GGUF file's quantized linear weights (attention and MLP projections, MoE
experts included, the LM head; formats of `strata.kernels.quant`) go to the device as their raw
blocks, parked on their `nn.Linear` as `quant_raw`; `CausalLM.pack` turns them into `QWeight`s (q|k|v
and gate|up stacked by rows of blocks) and each MoE layer's experts into two `QExpertStack`s
(`strata.kernels.quant.moe_q`: gate|up rows per expert, then the experts stacked); the float
parameter is never materialised. Embeddings and norms are read as floats."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from strata.config import ConfigError, ModelConfig
from strata.env import ENV
from strata.loaders.base import Checkpoint, LoadError
from strata.loaders.host import HostLayers, host_format, move_experts_to_ram, place_host_experts
from strata.models.layers import rope_inv_freq
from strata.models.mtp import MTPLayer
from strata.models.registry import build_model, model_class
from strata.models.transformer import CausalLM

log = logging.getLogger("strata")

__all__ = ["LoadError", "Checkpoint", "LoadedModel", "read_checkpoint", "load_model", "default_model_path", "host_format",
           "move_experts_to_ram"]


def default_model_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "default-model")


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: object
    path: str
    has_mtp: bool


def read_checkpoint(path: str) -> Checkpoint:
    if not os.path.exists(path):
        raise LoadError(path, "no such file or directory")
    if os.path.isdir(path):
        from strata.loaders.hf import read_hf_dir

        return read_hf_dir(path)
    if path.endswith(".gguf"):
        from strata.loaders.gguf import read_gguf

        return read_gguf(path)
    raise LoadError(path, "unknown model format (expected an HF directory or a .gguf file)")


def read_model(path: str | None) -> tuple[Checkpoint, ModelConfig]:
    """The checkpoint at `path` (None: the embedded model) and its model's configuration; a configuration
    Strata cannot run is a LoadError naming the file."""
    path = os.fspath(path or default_model_path())
    ckpt = read_checkpoint(path)
    try:
        return ckpt, ModelConfig.from_hf(ckpt.config)
    except ConfigError as e:
        raise LoadError(path, str(e)) from None


class _Progress:
    """The weight-loading bar, on stderr (stdout carries generated text only); STRATA_NO_PROGRESS hides it."""

    def __init__(self, total: int, label: str):
        from tqdm import tqdm

        # disable=None would also hide it whenever stderr is not a terminal; logs keep the bar's last state.
        self.bar = tqdm(total=total, desc=label, unit="tensor", file=sys.stderr, leave=True,
                        disable=ENV.NO_PROGRESS.get() or total <= 0)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)
        if self.bar.n >= (self.bar.total or 0):
            self.bar.close()


def mtp_prefix(cfg: ModelConfig, names: Collection[str]) -> str | None:
    """Where the checkpoint keeps its MTP head's tensors; None when it carries none, even where its config
    names MTP layers (HF transformers drops them on save)."""
    prefix = model_class(cfg).mtp_checkpoint_prefix or f"model.layers.{cfg.num_hidden_layers}."
    return prefix if cfg.num_nextn_predict_layers > 0 and any(n.startswith(prefix) for n in names) else None


def load_model(path: str | None = None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               progress: bool = True, pack_experts: bool = True, keep_quantized: bool = False,
               quantize: str | None = None, host_moe_layers: Collection[int] = (), host_experts: str = "auto",
               checkpoint: Checkpoint | None = None, layers: tuple[int, int] | None = None) -> LoadedModel:
    """`pack_experts=False` keeps projections unstacked and MoE layers on the reference loop path (e.g.
    to copy weights out for training). `keep_quantized`: see the module docstring (needs packing).
    `host_moe_layers`: decoder layers whose routed experts stay in host RAM, computed on the CPU in the
    format `host_experts` (`strata.models.host_experts`; "auto": `host_format`). `checkpoint`: `path`
    already read. `layers` (a, b): a pipeline stage's model, holding decoder layers a..b-1 only, the MTP
    layers when b is the last, the embedding and the LM head when a is 0 or the stage holds the MTP
    layers (`strata.models.held.elsewhere_prefixes`); the others' tensors are not read. `has_mtp` tells
    whether the checkpoint has an MTP head, whichever stage holds it."""
    path = os.fspath(path or default_model_path())
    ckpt = checkpoint or read_checkpoint(path)
    try:
        cfg = ModelConfig.from_hf(ckpt.config)
        # Without MTP tensors the model is built without a draft head.
        prefix = mtp_prefix(cfg, ckpt.names)
        with_mtp = prefix is not None
        elsewhere: tuple[str, ...] = ()
        build_mtp = with_mtp
        if layers is not None:
            from strata.models.held import elsewhere_prefixes, stage_check

            stage_check(cfg, *layers)
            elsewhere = elsewhere_prefixes(cfg, *layers, prefix)
            build_mtp = with_mtp and layers[1] == cfg.num_hidden_layers
        with torch.device("meta"):
            model = build_model(cfg, with_mtp=build_mtp)
    except ConfigError as e:
        raise LoadError(path, str(e)) from None
    if layers is not None:
        from strata.models.held import hold_ends, hold_layers, holds_ends

        hold_layers(model, *layers)
        if not holds_ends(cfg, *layers, with_mtp):
            hold_ends(model, torch.device(device), dtype)
    quantizable = _quantizable_linears(model) if keep_quantized and pack_experts and ckpt.raw else set()
    on_host = (place_host_experts(model, ckpt, host_moe_layers, host_experts, gpu=torch.device(device).type == "cuda")
               if pack_experts else set())
    host = HostLayers(model, ckpt, on_host, dtype, torch.device(device)) if on_host else None
    _assign_weights(model, ckpt, torch.device(device), dtype, progress, quantizable - on_host, host, elsewhere)
    if layers is not None:
        from strata.models.held import number_kv_layers

        number_kv_layers(model)
    if pack_experts:
        _pack(model, torch.device(device), dtype)
    if quantize == "fp8":
        if ckpt.raw is not None and keep_quantized:
            raise LoadError(path, "--quantize fp8 makes FP8 from float weights: not with --keep-quantized")
        if not pack_experts:
            raise LoadError(path, "--quantize fp8 needs the packed projections")
        from strata.models.quantize import quantize_fp8

        quantize_fp8(model)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the float projections just dropped
    elif quantize is not None:
        raise LoadError(path, f"unknown --quantize {quantize!r} (fp8)")
    if quantizable or quantize:
        _log_quantized(model)
    if quantizable:
        _log_expanded(ckpt, quantizable - on_host, dtype)
    model.eval()
    return LoadedModel(model=model, config=cfg, tokenizer=ckpt.tokenizer, path=path, has_mtp=with_mtp)


def _log_quantized(model: CausalLM) -> None:
    from strata.models.quantize import qweights_of
    from strata.kernels.quant.moe_q import QExpertStack

    kept = qweights_of(model)
    stacks = [s for m in model.modules() for s in getattr(m, "quant", None) or () if isinstance(s, QExpertStack)]
    if kept:
        types = ", ".join(sorted({q.ggml_type for q in kept}))
        log.info("kept %d linear weights quantized (%s): %.1f MiB", len(kept), types,
                 sum(q.nbytes for q in kept) / 2**20)
    if stacks:
        log.info("kept %d MoE expert stacks quantized (%s): %.1f MiB", len(stacks),
                 ", ".join(sorted({s.ggml_type for s in stacks})), sum(s.nbytes for s in stacks) / 2**20)
    if not kept and not stacks:
        from strata.kernels.quant import FORMATS

        log.info("no weight was kept quantized (no %s linear weights in this file)", " / ".join(FORMATS))


def _log_expanded(ckpt: Checkpoint, names: set[str], dtype: torch.dtype) -> None:
    """One line naming the quantized types of `names` that have no kernels here, and what expanding
    them to `dtype` costs."""
    from strata.kernels.quant import FORMATS

    size = torch.empty(0, dtype=dtype).element_size()
    expanded: dict[str, list[int]] = {}
    for n in names:
        stored = ckpt.types.get(n)
        if stored is None or stored in FORMATS or stored in ("F32", "F16", "BF16", "F64"):
            continue
        numel = 1
        for d in ckpt.shapes.get(n, ()):
            numel *= d
        entry = expanded.setdefault(stored, [0, 0])
        entry[0] += 1
        entry[1] += numel * size
    if expanded:
        log.warning("not kept quantized (no kernels for the type), expanded to %s: %s", str(dtype).removeprefix("torch."),
                    ", ".join(f"{t} ({c} tensors, {b / 2**20:.1f} MiB)" for t, (c, b) in sorted(expanded.items())))


def _pack(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """Stack projections and MoE experts (MTP layers' too): fewer GEMMs, and the sync-free grouped
    expert path. An embedding table kept quantized becomes a `QuantizedEmbedding` first."""
    if "quant_raw" in vars(model.model.embed_tokens):
        from strata.models.layers import QuantizedEmbedding

        tied = model.lm_head.weight is model.model.embed_tokens.weight
        model.model.embed_tokens = QuantizedEmbedding.take(model.model.embed_tokens, dtype)
        if tied:
            model.tie_weights()  # to the empty parameter: the head reads the same blocks (`CausalLM.pack`)
        else:
            model.model.embed_tokens.q.workspace = None  # looked up, never multiplied by
    model.pack()
    if device.type == "cuda":
        # The unstacked tensors just freed sit in PyTorch's cache; the engine sizes the KV pool from
        # the device's free memory, so give them back.
        torch.cuda.empty_cache()


def _optional_mtp_copies(model: CausalLM, names: set[str]) -> None:
    """GLM-4.5 stores the MTP layer's own embedding and head; give the modules slots for them."""
    for layer in model.mtp_layers:
        if not isinstance(layer, MTPLayer):
            continue  # a layout without optional copies
        prefix = f"model.layers.{layer.self_attn.layer_idx}."
        cfg = model.config
        with torch.device("meta"):
            if prefix + "embed_tokens.weight" in names:
                layer.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            if prefix + "shared_head.head.weight" in names:
                layer.shared_head.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def _quantizable_linears(model: CausalLM) -> set[str]:
    """Weight names that may stay quantized: attention and MLP projections (MoE experts' too), the
    projections another architecture's layers name in `QUANTIZABLE`, the LM head."""
    from strata.models.layers import MLP, Attention

    out = set()
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            out |= {f"{name}.{p}_proj.weight" for p in "qkvo"}
        elif isinstance(m, MLP):
            out |= {f"{name}.{p}_proj.weight" for p in ("gate", "up", "down")}
        else:
            out |= {f"{name}.{p}.weight" for p in getattr(m, "QUANTIZABLE", ())}
    if not model.config.tie_word_embeddings:
        out.add("lm_head.weight")
    out.add("model.embed_tokens.weight")  # `QuantizedEmbedding`
    return out


def _assign_weights(model: CausalLM, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, progress: bool,
                    quantizable: set[str] = frozenset(), host: HostLayers | None = None,
                    elsewhere: tuple[str, ...] = ()) -> None:
    """`elsewhere`: name prefixes of tensors another pipeline stage holds (not read here)."""
    names = {n for n in ckpt.names if not n.startswith(elsewhere)} if elsewhere else set(ckpt.names)
    cfg = model.config
    _optional_mtp_copies(model, names)
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if n in model.state_dict()}
    expected = set(params) | set(buffers)
    tied = "lm_head.weight" not in names and cfg.tie_word_embeddings
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - names)
    extra = sorted(n for n in names - expected if not n.endswith("rotary_emb.inv_freq"))
    for kind, lst in (("missing", missing), ("unexpected", extra)):
        if lst:
            more = f" (+{len(lst) - 3} more)" if len(lst) > 3 else ""
            raise LoadError(ckpt.path, f"{kind} tensors: {', '.join(lst[:3])}{more}")

    bar = _Progress(len(expected), "loading weights") if progress else None
    on_host = host.names if host is not None else frozenset()
    for name in sorted(expected):
        if name in on_host:
            host.add(name)
            if bar:
                bar.advance()
            continue
        raw = ckpt.raw(name) if name in quantizable else None
        if raw is not None:
            module_name, _, _ = name.rpartition(".")
            module = model.get_submodule(module_name)
            if raw[1].shape[0] != module.weight.shape[0]:
                raise LoadError(ckpt.path, f"shape mismatch for {name}: file has {raw[1].shape[0]} rows, "
                                           f"model expects {module.weight.shape[0]}")
            module.quant_raw = (raw[0], raw[1].to(device))  # the weight itself stays on meta
            if bar:
                bar.advance()
            continue
        t = ckpt.get(name)
        target = params.get(name)
        if target is None:
            target = buffers[name]
        if tuple(t.shape) != tuple(target.shape):
            raise LoadError(ckpt.path, f"shape mismatch for {name}: file has {tuple(t.shape)}, model expects {tuple(target.shape)}")
        # The routing bias stays fp32: bf16 would reorder near-tied expert scores.
        want = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        value = t.to(device=device, dtype=want)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if name in params:
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
        else:
            module.register_buffer(attr, value)
        if bar:
            bar.advance()
    if host is not None:
        host.check_done()
    if tied:
        model.tie_weights()
    # Non-persistent buffers (rotary frequencies) are computed, not loaded.
    model.rotary.inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)[0].to(device)
