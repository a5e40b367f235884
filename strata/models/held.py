"""A pipeline stage's model: the decoder layers it holds, and placeholders for those another stage holds.

The module list keeps every index, so checkpoint names and the model's forward stay as they are; a
placeholder passes the hidden states through and has no weights, no K/V and no linear-attention state.
The held layers' attention indices are renumbered in pool order (held decoder layers, then MTP layers),
and a hybrid's linear layers' state indices likewise, so a stage's KV pool and state pool have rows for
its own layers only (`num_attention_layers` and `new_states` count them).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.config import ConfigError, ModelConfig


class HeldElsewhere(nn.Module):
    """A decoder layer that another pipeline stage computes."""

    held_elsewhere = True

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope, attn):
        return x, residual


class WeightElsewhere(nn.Module):
    """The embedding or the LM head on a stage that does not apply them (`holds_ends`): it reads no
    tensor of theirs. `weight` is empty, on the stage's device and dtype (what packing reads)."""

    held_elsewhere = True

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.zeros(0, 0, dtype=dtype, device=device), persistent=False)


def hold_ends(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace the embedding and the LM head by placeholders (`holds_ends` false)."""
    model.model.embed_tokens = WeightElsewhere(device, dtype)
    model.lm_head = WeightElsewhere(device, dtype)


def elsewhere_prefixes(cfg: ModelConfig, first: int, last: int, mtp_prefix: str | None) -> tuple[str, ...]:
    """Checkpoint name prefixes a stage holding decoder layers first..last-1 does not read: the other
    decoder layers; the MTP head (`mtp_prefix`, None: the checkpoint has none) unless the stage is the
    last; the embedding and the LM head unless it is the first, or the last holding the MTP head (which
    embeds the tokens it drafts from and applies the head to its rows). One rule for the loader and
    the memory plan."""
    out = tuple(f"model.layers.{i}." for i in range(cfg.num_hidden_layers) if not first <= i < last)
    is_last = last == cfg.num_hidden_layers
    if mtp_prefix is not None and not is_last:
        out += (mtp_prefix,)
    if not holds_ends(cfg, first, last, mtp_prefix is not None):
        out += ("model.embed_tokens.", "lm_head.")
    return out


def holds_ends(cfg: ModelConfig, first: int, last: int, has_mtp: bool) -> bool:
    """Whether the stage of layers first..last-1 holds the embedding and the LM head."""
    return first == 0 or (has_mtp and last == cfg.num_hidden_layers)


def stage_check(cfg: ModelConfig, first: int, last: int) -> None:
    """Refuse a layer range a stage cannot hold."""
    if not 0 <= first < last <= cfg.num_hidden_layers:
        raise ConfigError(f"layers {first}..{last - 1} are not a range of the model's {cfg.num_hidden_layers}")


def hold_layers(model: nn.Module, first: int, last: int) -> None:
    """Replace the decoder layers outside first..last-1 by placeholders."""
    layers = model.model.layers
    for i in range(model.num_layers):
        if not first <= i < last:
            layers[i] = HeldElsewhere(i)


def number_kv_layers(model: nn.Module) -> None:
    """The held layers' K/V indices, 0.. in module order, MTP layers last; a hybrid's linear layers'
    state indices 0.. among its own (after the weights are assigned: the loader names MTP tensors by the
    original index; before packing: the CPU decode plans copy the index)."""
    held = [m for m in model.model.layers if not getattr(m, "held_elsewhere", False)]
    held += [m for m in model.mtp_layers if all(m is not h for h in held)]  # qwen3_next keeps them apart
    kv = linear = 0
    for layer in held:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.linear_idx = linear
            linear += 1
            continue
        attn = layer.self_attn
        if hasattr(attn, "kv_idx"):
            attn.kv_idx = kv
        else:
            attn.layer_idx = kv
        kv += 1
