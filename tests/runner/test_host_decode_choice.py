"""`--host-expert-decode`: the GPU's fused decode kernels reading a layer's experts in RAM in place (the
pinned copy kept for streaming), checked here on the CPU with the kernels interpreted: they read the
stacks wherever they are and give the CPU copy's sum; a layer so set up takes them for decode-sized
steps and leaves its CPU copy alone; the choice falls back to the CPU where a layer lacks the copy."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from strata.kernels.quant import random_blocks
from strata.kernels.quant.moe_q import QExpertStack
from strata.loaders.host import host_experts_of
from strata.models.moe import pcie_decode, pcie_serves
from strata.runner.host_offload import choose_host_decode, pcie_stacks_of

E, H, INTER, K = 6, 256, 256, 2


def _layer(ggml_type: str, fmt: str, stream: bool = True, h: int = H, inter: int = INTER):
    g = torch.Generator().manual_seed(7)
    if ggml_type == "BF16":  # a float file: the stacks themselves
        w13 = torch.randn(E, 2 * inter, h, generator=g).div(16).bfloat16()
        w2 = torch.randn(E, h, inter, generator=g).div(16).bfloat16()
    else:
        w13 = QExpertStack.from_raw(ggml_type, random_blocks(ggml_type, E * 2 * inter, h, g, "cpu").view(E, 2 * inter, -1))
        w2 = QExpertStack.from_raw(ggml_type, random_blocks(ggml_type, E * h, inter, g, "cpu").view(E, h, -1))
    return SimpleNamespace(host=host_experts_of(fmt, w13, w2, torch.bfloat16, torch.device("cpu"), stream),
                           pcie_stacks=None, pcie_config=None, cpu_slots=0)


@pytest.mark.parametrize("ggml_type,fmt", [("IQ3_S", "compiled-int4"), ("Q8_0", "int8"), ("BF16", "float")])
def test_the_kernels_read_the_pinned_copy_in_place_and_give_the_cpu_copys_sum(ggml_type, fmt):
    layer = _layer(ggml_type, fmt)
    stacks = pcie_stacks_of(layer, K, torch.bfloat16, torch.device("cpu"))
    assert stacks is not None
    region = layer.host.stream.region  # the StreamStack's own region, not a copy
    first = stacks[0] if isinstance(stacks[0], torch.Tensor) else next(iter(stacks[0].planes.values()))
    assert region.data_ptr() <= first.data_ptr() < region.data_ptr() + region.numel()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, H, generator=g)
    ids = torch.rand(3, E, generator=g).argsort(dim=1)[:, :K].contiguous()
    w = torch.softmax(torch.randn(3, K, generator=g), dim=-1)
    assert pcie_serves(x.bfloat16(), K, *stacks) and not pcie_serves(x, K, *stacks)  # bf16/fp16 rows only
    got = pcie_decode(x.bfloat16(), ids, w, *stacks).float()
    ref = layer.host.forward(x.bfloat16() if fmt == "float" else x.bfloat16().float(), ids, w).float()
    assert float((got - ref).norm()) <= 0.02 * float(ref.norm())


def test_a_layer_without_the_pinned_copy_keeps_the_cpu(caplog):
    layers = [_layer("Q8_0", "int8"), _layer("Q8_0", "int8", stream=False)]
    assert layers[1].host.stream is None and pcie_stacks_of(layers[1], K, torch.bfloat16, torch.device("cpu")) is None
    with caplog.at_level(logging.WARNING, logger="strata"):
        assert choose_host_decode(layers, "pcie", K, torch.bfloat16, torch.device("cpu")) == "cpu"
    assert "without a pinned copy" in caplog.text and all(m.pcie_stacks is None for m in layers)
    assert choose_host_decode(layers[:1], "cpu", K, torch.bfloat16, torch.device("cpu")) == "cpu"
    assert layers[0].pcie_stacks is None
    assert choose_host_decode(layers[:1], "pcie", K, torch.bfloat16, torch.device("cpu")) == "pcie"
    assert layers[0].pcie_stacks is not None
    # Set up again (the same model under a new engine): the CPU asked for, the stacks are dropped.
    assert choose_host_decode(layers[:1], "cpu", K, torch.bfloat16, torch.device("cpu")) == "cpu"
    assert layers[0].pcie_stacks is None


def test_a_layer_given_the_stacks_runs_decode_steps_through_them_and_not_its_cpu_copy(tmp_path):
    """An IQ3_S GGUF with every MoE layer's experts in RAM (compiled-int4): with `pcie_stacks` set (here
    the file's blocks as a keep-quantized load stacks them) a step of a few tokens never calls the CPU copy,
    and gives the logits of the steps the CPU computes."""
    import dataclasses
    import os
    import sys

    from strata.attention import CausalBatch
    from strata.bench.random_model import shape_config
    from strata.loaders import load_model
    from strata.models.moe import MoE

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "loaders"))
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    from quant_gguf import write_moe
    from test_gguf import write_vocab_gguf

    mc = dataclasses.replace(shape_config("tiny-moe"), hidden_size=256, head_dim=64, moe_intermediate_size=256)
    path = str(tmp_path / "iq3s.gguf")
    write_moe(SimpleNamespace(out=path, format="IQ3_S", vocab=write_vocab_gguf(tmp_path), seed=0), mc,
              mc.num_hidden_layers)
    ids = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(2))
    model = load_model(path, progress=False, dtype=torch.bfloat16, host_moe_layers=[0, 1]).model
    kept = load_model(path, progress=False, dtype=torch.bfloat16, keep_quantized=True).model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert all(m.host is not None and m.host.fmt == "compiled-int4" for m in moes)

    def logits():
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(4), CausalBatch(1, 4))).float()

    on_cpu = logits()
    assert all(m.host.seconds > 0 for m in moes)
    for m, q in zip(moes, [m for m in kept.modules() if isinstance(m, MoE)]):
        m.pcie_stacks, m.host.seconds = q.quant, 0.0
    read = logits()
    assert all(m.host.seconds == 0.0 for m in moes)
    assert float((read - on_cpu).norm()) <= 0.05 * float(on_cpu.norm())
    # --host-expert-decode both: each row's first expert on the CPU, the second read by the kernels.
    calls = []
    for m in moes:
        m.cpu_slots = 1
        forward = m.host.forward
        m.host.forward = lambda x, ids, w, out=None, forward=forward: calls.append(ids.shape) or forward(x, ids, w, out)
    both = logits()
    assert calls and all(shape[1] == 1 for shape in calls)
    assert float((both - on_cpu).norm()) <= 0.05 * float(on_cpu.norm())
    assert float((both - read).norm()) <= 0.05 * float(on_cpu.norm())


def test_the_offload_bench_times_a_layers_step_each_way():
    from strata.bench.offload import layer_step_figures

    layers = [_layer("Q8_0", "int8"), _layer("Q8_0", "int8", stream=False)]
    figures = layer_step_figures(layers, K, torch.bfloat16, torch.device("cpu"))
    assert figures["layer_step_cpu_ms"] > 0 and figures["layer_step_pcie_ms"] > 0 and figures["pcie_read_gb_s"] > 0
    assert list(figures["layer_step_split_ms"]) == [0, 1, 2] and min(figures["layer_step_split_ms"].values()) > 0
    assert set(layer_step_figures(layers[1:], K, torch.bfloat16, torch.device("cpu"))) == {"layer_step_cpu_ms"}
    file = layer_step_figures([_layer("Q8_0", "file")], K, torch.bfloat16, torch.device("cpu"))
    assert "layer_step_cpu_ms" not in file and set(file["layer_step_split_ms"]) == {0}


def test_the_pcie_tiles_are_the_fastest_of_those_that_give_the_default_sum(monkeypatch, caplog):
    """IQ3_S rows of two super-blocks: `pcie_configs` offers longer K steps; the choice keeps the tiles the
    probe timed fastest (times made up here: the kernels run interpreted), and leaves out tiles whose sum
    is not the default tiles' (as a device that miscompiles them would give)."""
    import dataclasses

    import strata.runner.host_offload as ho
    from strata.kernels.quant import moe_decode_q

    shipped = moe_decode_q.decode_config  # 64-row blocks: the interpreter's cost is per program
    monkeypatch.setattr(moe_decode_q, "decode_config",
                        lambda *a: dataclasses.replace(shipped(*a), gate_up_block_i=64, down_block_h=64))
    monkeypatch.setattr(ho, "pcie_step_seconds",
                        lambda *a, config=None: 0.5 if config is not None and config.gate_up_block_k == 512 else 1.0)
    layer = _layer("IQ3_S", "compiled-int4", h=512, inter=512)
    default, longer = moe_decode_q.pcie_configs("IQ3_S", 512, 512)
    assert choose_host_decode([layer], "pcie", K, torch.bfloat16, torch.device("cpu")) == "pcie"
    assert layer.pcie_config == longer and longer.gate_up_block_k == 512

    read = ho.pcie_decode
    monkeypatch.setattr(ho, "pcie_decode", lambda *a, config=None: read(*a, config=config) * (2 if config else 1))
    with caplog.at_level(logging.INFO, logger="strata"):
        config, seconds = ho.fastest_pcie_config(layer.host, layer.pcie_stacks, K, torch.bfloat16, torch.device("cpu"))
    assert config is None and seconds == 1.0 and "left out" in caplog.text


@pytest.mark.parametrize("cpu_slots", [0, 1, K])
def test_a_split_step_is_timed_with_any_share_on_the_cpu(cpu_slots):
    """`split_step_seconds` runs a row through the layer with the CPU taking 0, some or all of its experts
    (the kernels interpreted here): a time for each, and the CPU copy's counters left as they were."""
    import strata.runner.host_offload as ho

    layer = _layer("Q8_0", "int8")
    stacks = pcie_stacks_of(layer, K, torch.bfloat16, torch.device("cpu"))
    before = (layer.host.seconds, layer.host.bytes_read)
    assert ho.split_step_seconds(layer.host, stacks, K, cpu_slots, torch.bfloat16, torch.device("cpu"), repeats=1) > 0
    assert (layer.host.seconds, layer.host.bytes_read) == before


def test_the_probe_times_a_few_shares_of_the_cpus():
    from strata.runner.host_offload import split_counts

    assert split_counts(10, "auto") == [0, 2, 5, 8, 10] and split_counts(10, "both") == [2, 5, 8]
    assert split_counts(2, "auto") == [0, 1, 2] and split_counts(2, "both") == [1]
    assert split_counts(1, "auto") == [0, 1] and split_counts(1, "both") == []


@pytest.mark.parametrize("way,times,want,slots", [
    ("auto", {0: 3.0, 1: 1.0, 2: 2.0}, "both", 1),   # the split measured fastest
    ("auto", {0: 1.0, 1: 2.0, 2: 3.0}, "pcie", 0),   # the GPU alone
    ("auto", {0: 3.0, 1: 2.0, 2: 1.0}, "cpu", 0),    # the CPU alone
    ("both", {0: 0.5, 1: 1.0, 2: 0.1}, "both", 1),   # both asked for: the CPU takes some, never all or none
])
def test_the_cpus_share_of_a_rows_experts_is_the_one_measured_fastest(monkeypatch, way, times, want, slots):
    import strata.runner.host_offload as ho

    monkeypatch.setattr(ho, "split_step_seconds", lambda host, stacks, k, c, *a: times[c])
    monkeypatch.setattr(ho, "pcie_step_seconds", lambda *a, **kw: 1.0)
    warmed = []
    monkeypatch.setattr(ho, "warm_compiled_steps", lambda moes, k: warmed.append(k))
    layers = [_layer("Q8_0", "int8"), _layer("Q8_0", "int8")]
    assert choose_host_decode(layers, way, K, torch.bfloat16, torch.device("cpu")) == want
    assert all(m.cpu_slots == slots for m in layers)
    assert all((m.pcie_stacks is not None) == (want != "cpu") for m in layers)
    assert warmed == ([slots] if slots else [])  # the CPU's one-token kernel built for its share, at start-up
    assert choose_host_decode(layers, "pcie", K, torch.bfloat16, torch.device("cpu")) == "pcie"
    assert all(m.cpu_slots == 0 for m in layers)


@pytest.mark.parametrize("way", ["auto", "cpu", "both", "pcie"])
def test_experts_without_a_cpu_copy_are_read_over_pcie_whatever_was_asked(monkeypatch, caplog, way):
    """host_experts file: no CPU copy to time or compute from, so decode reads the experts over PCIe (the
    probe's sum checked against the blocks themselves), with a warning where the CPU was asked for."""
    import strata.runner.host_offload as ho

    monkeypatch.setattr(ho, "split_step_seconds", lambda *a, **kw: pytest.fail("no CPU copy to time"))
    layer = _layer("Q8_0", "file")
    assert not layer.host.on_cpu and layer.host.nbytes == layer.host.stream.nbytes
    with caplog.at_level(logging.WARNING, logger="strata"):
        assert choose_host_decode([layer], way, K, torch.bfloat16, torch.device("cpu")) == "pcie"
    assert layer.pcie_stacks is not None and layer.cpu_slots == 0
    assert ("no CPU copy" in caplog.text) == (way in ("cpu", "both"))


def test_the_blocks_reference_is_the_kernels_sum():
    from strata.runner.host_offload import stacks_reference

    layer = _layer("Q8_0", "int8")
    stacks = pcie_stacks_of(layer, K, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, H, generator=g).bfloat16()
    ids = torch.rand(2, E, generator=g).argsort(dim=1)[:, :K].contiguous()
    w = torch.softmax(torch.randn(2, K, generator=g), dim=-1)
    ref = stacks_reference(stacks, x, ids, w)
    got = pcie_decode(x, ids, w, *stacks).float()
    assert float((got - ref).norm()) <= 0.02 * float(ref.norm())
    assert float((layer.host.forward(x.float(), ids, w) - ref).norm()) <= 0.02 * float(ref.norm())
