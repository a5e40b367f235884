"""What a CUDA run with routed experts in RAM runs without (`host_limits`): async scheduling goes where the
CPU computes decode steps' experts (the host waits for each such layer's router) and stays where the GPU
reads them over PCIe; graphs are cut into pieces around the CPU's part, or off. Decided from the layers
as set up, on made-up layers: no GPU needed."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig, ModelConfig
from strata.engine.startup import host_limits
from strata.models.moe import MoE

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, model_type="qwen3_moe", num_experts=4,
             num_experts_per_tok=2)


def _model(host: tuple[bool, ...], pcie: tuple[bool, ...]) -> torch.nn.Module:
    layers = torch.nn.ModuleList(MoE(ModelConfig(**SMALL)) for _ in host)
    for m, h, p in zip(layers, host, pcie):
        m.host = object() if h else None
        m.pcie_stacks = (object(), object()) if p else None
    return layers


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(device="cuda", **kw).resolved()


def test_experts_computed_on_the_cpu_turn_async_scheduling_off_and_cut_the_graphs():
    cfg = host_limits(_cfg(), _model((True, True), (False, False)), CUDA, staged=False)
    assert cfg.async_scheduling is False and cfg.cuda_graph is True
    cfg = host_limits(_cfg(host_expert_graphs=False), _model((True, True), (False, False)), CUDA, staged=False)
    assert cfg.async_scheduling is False and cfg.cuda_graph is False


def test_experts_read_over_pcie_keep_async_scheduling():
    assert _cfg().async_scheduling is True
    cfg = host_limits(_cfg(), _model((True, False), (True, False)), CUDA, staged=False)
    assert cfg.async_scheduling is True and cfg.cuda_graph is True
    # One layer the CPU computes is enough for the host to wait in every decode step.
    cfg = host_limits(_cfg(), _model((True, True), (True, False)), CUDA, staged=False)
    assert cfg.async_scheduling is False
    # Each row's experts shared with the CPU (--host-expert-decode both): the host waits too.
    model = _model((True,), (True,))
    model[0].cpu_slots = 1
    assert host_limits(_cfg(), model, CUDA, staged=False).async_scheduling is False
    # Not turned on where the user turned it off.
    cfg = host_limits(_cfg(async_scheduling=False), _model((True,), (True,)), CUDA, staged=False)
    assert cfg.async_scheduling is False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_nothing_changes_without_experts_in_ram_or_off_cuda(device):
    cfg = _cfg()
    assert host_limits(cfg, _model((False, False), (False, False)), torch.device(device), staged=False) == cfg
    if device == "cpu":
        assert host_limits(cfg, _model((True,), (False,)), torch.device(device), staged=False) == cfg
