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
import math
import re
import os
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from strata.config import ConfigError, ModelConfig
from strata.env import ENV
from strata.loaders.base import Checkpoint, LoadError
from strata.models.layers import rope_inv_freq
from strata.models.mtp import MTPLayer
from strata.models.registry import build_model, model_class
from strata.models.transformer import CausalLM

log = logging.getLogger("strata")

__all__ = ["LoadError", "Checkpoint", "LoadedModel", "read_checkpoint", "load_model", "default_model_path"]


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
    on_host = _place_host_experts(model, ckpt, host_moe_layers, host_experts) if pack_experts else set()
    host = _HostLayers(model, ckpt, on_host, dtype, torch.device(device)) if on_host else None
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


def host_format(stored_type: str | None, shapes: Collection[tuple[int, int]], int8_fits: bool = True) -> str:
    """The CPU format of routed experts stored as `stored_type` (a safetensors dtype or GGUF type name):
    float for float weights (exact); for quantized files the fastest CPU kernel measured for a row
    (bench/results/host_expert_kernels_cuda.txt, on the H100 host): fbgemm (97 GB/s of experts), else
    w8a8 (oneDNN's int8 GEMM, 50 GB/s; torch's weight-only int8 and int4 kernels read 9 and 1.5), unless
    host RAM cannot hold an int8 copy (`int8_fits`): then int4 (groups of 32, about 5 bits with its
    scales), where every weight's shape takes it."""
    from strata.models.host_experts import format_fits, has_fbgemm

    if stored_type is None or stored_type.upper() in ("F32", "F16", "BF16", "F64"):
        return "float"
    if int8_fits or not all(format_fits("int4", *s) for s in shapes):
        return "fbgemm" if has_fbgemm() else "w8a8"
    return "int4"


def host_memory_available() -> int | None:
    """Bytes the kernel says new allocations can take without swapping (MemAvailable), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _place_host_experts(model: CausalLM, ckpt: Checkpoint, layers: Collection[int], fmt: str) -> set[str]:
    """Marks the MoE layers among `layers` to keep their routed experts in RAM (`MoE.host_format`);
    returns those experts' tensor names, which `_HostLayers` gathers as they are read."""
    from strata.models.moe import MoE

    names: set[str] = set()
    int8_fits = True
    if fmt == "auto" and layers:
        # An int8 copy of every expert placed in RAM, beside the file's blocks kept for streaming.
        prefixes = tuple(f"model.layers.{i}.mlp.experts." for i in layers)
        mine = [n for n in ckpt.names if n.startswith(prefixes)]
        need = sum(math.prod(ckpt.shapes.get(n, ())) + ckpt.nbytes.get(n, 0) for n in mine)
        available = host_memory_available()
        int8_fits = available is None or need <= 0.9 * available
        if not int8_fits:
            log.info("routed experts in RAM as int4: an int8 copy (%.1f GiB with the streaming copy) is more than "
                     "the %.1f GiB of host memory available", need / 2**30, available / 2**30)
    for i in sorted(set(layers)):
        if i >= model.num_layers:
            raise LoadError(ckpt.path, f"no layer {i} to place experts of (the model has {model.num_layers})")
        moe = next((m for m in model.model.layers[i].modules() if isinstance(m, MoE)), None)
        if moe is None:
            continue  # a dense layer of a MoE model: nothing to place
        prefix = next(n for n, m in model.named_modules() if m is moe) + ".experts."
        mine = {n for n in ckpt.names if n.startswith(prefix)}
        inter, hidden = moe.experts[0].gate_proj.weight.shape
        stored = ckpt.types.get(min(mine)) if mine else None
        moe.host_format = host_format(stored, [(2 * inter, hidden), (hidden, inter)], int8_fits) if fmt == "auto" else fmt
        names |= mine
    return names


class _HostLayers:
    """The routed experts of the layers placed in RAM, gathered as they are read; a layer's
    `HostExperts` is made as soon as its last expert arrives, so at most one layer is held in float.
    On CUDA each layer is also kept in the GPU's format for the streamer (the file's blocks where the GPU
    has kernels for them, else the float stack in the model's dtype), and quantized blocks are converted
    to the CPU format on the GPU, a few experts at a time (on the host, an 80B-A3B IQ3_S file's
    conversion takes minutes)."""

    _NAME = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

    def __init__(self, model: CausalLM, ckpt: Checkpoint, names: set[str], dtype: torch.dtype, device: torch.device):
        from strata.models.moe import MoE

        self.stream = device.type == "cuda"
        self.work = device if self.stream else torch.device("cpu")
        self.ckpt, self.dtype, self.names = ckpt, dtype, names
        self.pending: dict[int, dict] = {}
        self.built, self.seconds = 0, 0.0
        self.moe_of: dict[str, MoE] = {}
        for name, m in model.named_modules():
            if isinstance(m, MoE) and m.host_format is not None:
                self.moe_of[name + ".experts."] = m

    def add(self, name: str) -> None:
        prefix = name[: name.index(".experts.") + len(".experts.")]
        moe = self.moe_of[prefix]
        e, proj = self._NAME.search(name).groups()
        raw = self.ckpt.raw(name) if self.ckpt.raw is not None else None
        value = raw if raw is not None else self.ckpt.get(name)
        got = self.pending.setdefault(id(moe), {})
        got[(int(e), proj)] = value
        if len(got) == 3 * moe.num_experts:
            del self.pending[id(moe)]
            t0 = time.perf_counter()
            self._build(moe, got)
            self.built, self.seconds = self.built + 1, self.seconds + time.perf_counter() - t0

    def _build(self, moe, got: dict) -> None:
        from strata.kernels.quant.moe_q import QExpertStack

        n = moe.num_experts
        trios = [(got[(e, "gate")], got[(e, "up")], got[(e, "down")]) for e in range(n)]
        raws = all(isinstance(v, tuple) for t in trios for v in t)
        types13 = {v[0] for t in trios for v in t[:2]} if raws else set()
        types2 = {t[2][0] for t in trios} if raws else set()
        if raws and len(types13) == 1 and len(types2) == 1:
            w13 = QExpertStack.from_raw(types13.pop(), torch.stack([torch.cat([g[1], u[1]]) for g, u, _ in trios]))
            w2 = QExpertStack.from_raw(types2.pop(), torch.stack([d[1] for _, _, d in trios]))
        else:
            floats = [[self._float(v) for v in t] for t in trios]
            w13 = torch.stack([torch.cat([g, u]) for g, u, _ in floats])
            w2 = torch.stack([d for _, _, d in floats])
            del floats
        del trios, got
        moe.host = host_experts_of(moe.host_format, w13, w2, self.dtype, self.work, self.stream)
        _empty_experts(moe, self.dtype)

    def _float(self, v) -> torch.Tensor:
        if not isinstance(v, tuple):
            return v.float()
        from strata.kernels.quant import format_module

        mod = format_module(v[0])
        return mod.dequantize(mod.repack(v[1]), v[1].shape[0], v[1].shape[1] // mod.BLOCK_BYTES * mod.BLOCK_VALUES)

    def check_done(self) -> None:
        if self.pending:
            raise LoadError(self.ckpt.path, f"{len(self.pending)} MoE layers placed in RAM lack some of their experts")
        log.info("routed experts of %d MoE layers made ready for RAM in %.1f s (converted on the %s)", self.built,
                 self.seconds, "GPU" if self.stream else "CPU")


CHUNK = 8  # experts converted at once: ~0.4 GiB of fp32 temporaries at 80B-A3B's expert shape


def host_experts_of(fmt: str, w13, w2, dtype: torch.dtype, work: torch.device, stream: bool):
    """One MoE layer's routed experts as `HostExperts` in the CPU format `fmt`, from (w13, w2): the file's
    blocks as `QExpertStack`s, or float stacks [E, 2I, H] and [E, H, I], on any device. Quantized blocks
    are converted on `work` a few experts at a time; `stream`: also kept in the GPU's format (the blocks,
    else the float stack in `dtype`), pinned, for the streamer."""
    from strata.models.host_experts import HostExperts, StreamStack

    quant = not isinstance(w13, torch.Tensor)
    n, rows, hidden = (w13.num_experts, w13.n, w13.k) if quant else tuple(w13.shape)
    float_dtype = dtype if fmt == "float" else torch.float32
    host = HostExperts(fmt, n, rows // 2, hidden, float_dtype)
    if quant:
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            host.set(a, torch.stack([w13.dequantize_expert(e, work) for e in range(a, b)]),
                     torch.stack([w2.dequantize_expert(e, work) for e in range(a, b)]))
        if stream:
            host.stream = StreamStack.of_quant(w13, w2)
        return host
    w13, w2 = w13.to("cpu", float_dtype), w2.to("cpu", float_dtype)
    if stream:
        host.stream = StreamStack.of_float(w13.to(dtype), w2.to(dtype))
        if fmt == "float" and float_dtype == dtype:
            # The CPU computes from the pinned stack itself: one copy in RAM, not two.
            host.gate_up.w, host.down.w = host.stream.stacks(host.stream.region)
    if host.stream is None or host.gate_up.w.data_ptr() != host.stream.region.data_ptr():
        host.set(0, w13, w2)
    return host


def _empty_experts(moe, dtype: torch.dtype) -> None:
    """The experts' own parameters emptied once `moe.host` holds them."""
    for m in moe.experts:
        for lin in (m.gate_proj, m.up_proj, m.down_proj):
            lin.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def move_experts_to_ram(model: CausalLM, ckpt: Checkpoint, layers: Collection[int], fmt: str,
                        dtype: torch.dtype) -> None:
    """MoE layers `layers`, loaded with their routed experts on the GPU, keep them in host RAM instead, in
    the format a load would have placed them in (`fmt`, "auto": `host_format`): a memory plan made again
    after the load held more than the plan estimated (`strata.memory_plan.beyond_estimate`)."""
    from strata.models.moe import MoE

    _place_host_experts(model, ckpt, layers, fmt)
    for i in sorted(set(layers)):
        layer = model.model.layers[i]
        moe = next((m for m in layer.modules() if isinstance(m, MoE)), None)
        if moe is None or moe.host is not None:
            continue
        if moe.quant is not None:
            w13, w2 = moe.quant
        elif moe.w13 is not None and moe.w13_ext is None and moe.fp8 is None:
            w13, w2 = moe.w13, moe.w2
        else:
            raise LoadError(ckpt.path, f"layer {i}'s routed experts cannot move to RAM after the load")
        device = w13.device
        moe.host = host_experts_of(moe.host_format, w13, w2, dtype, device, device.type == "cuda")
        moe.quant = moe.qdecode = None
        moe.w13 = moe.w2 = None
        del w13, w2
        _empty_experts(moe, dtype)
        moe.pack_experts()  # the host path: routing workspaces, `path`
        if getattr(layer, "cpu_plan", None) is not None:
            layer.plan_cpu(None)  # a CPU plan made with the experts in place covers the layer no more


def _assign_weights(model: CausalLM, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, progress: bool,
                    quantizable: set[str] = frozenset(), host: _HostLayers | None = None,
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
