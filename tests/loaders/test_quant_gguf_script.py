"""scripts/quant_gguf.py's qwen3moe files (the MoE GGUF `strata bench offload` and llama-bench time) at
the tiny-moe shape: Strata reads back the shape and the quantized expert stacks, and the model with its
experts in host RAM as float gives the logits of the model with them in place."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import gguf
import pytest
import torch

from strata.attention import CausalBatch
from strata.bench.random_model import shape_config
from strata.loaders import load_model
from strata.loaders.gguf import read_gguf
from test_gguf import write_vocab_gguf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from quant_gguf import write_moe  # noqa: E402


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("moe")
    path = str(d / "moe.gguf")
    mc = shape_config("tiny-moe")
    write_moe(SimpleNamespace(out=path, format="Q8_0", vocab=write_vocab_gguf(d), seed=0), mc, mc.num_hidden_layers)
    return path


def test_the_file_holds_the_shape_and_quantized_expert_stacks(moe_file):
    reader = gguf.GGUFReader(moe_file)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == "Q8_0" and kinds["blk.1.ffn_down_exps.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32"
    stack = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert list(stack.shape) == [32, 64, 8]  # ggml order: K, N, E
    cfg = read_gguf(moe_file).config
    mc = shape_config("tiny-moe")
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (8, 2, 32)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (mc.hidden_size, mc.num_hidden_layers)


def test_experts_in_ram_as_float_give_the_same_logits(moe_file):
    ids = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(0))

    def logits(**kw):
        lm = load_model(moe_file, progress=False, **kw)
        with torch.no_grad():
            return lm.model.compute_logits(lm.model(ids, torch.arange(16), CausalBatch(1, 16)))

    placed = logits()
    torch.testing.assert_close(logits(host_moe_layers=[0, 1], host_experts="float"), placed, rtol=1e-5, atol=1e-5)
    int8 = logits(host_moe_layers=[0, 1], host_experts="int8")
    assert float((int8 - placed).norm() / placed.norm()) < 0.05


@pytest.mark.parametrize("fmt", ["float", "int8"])
def test_experts_moved_to_ram_after_the_load_give_the_logits_of_a_load_that_placed_them_there(moe_file, fmt):
    """A memory plan made again after the load (`strata.engine.startup.refit_after_load`) moves layers'
    experts, loaded in place (the file's blocks kept quantized, or expanded), to RAM: the same logits as a
    load that put them there from the start."""
    from strata.loaders import move_experts_to_ram, read_checkpoint
    from strata.models.moe import MoE

    ids = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(1))

    def logits(model):
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(16), CausalBatch(1, 16)))

    for keep in (True, False):
        placed = load_model(moe_file, progress=False, keep_quantized=keep, host_moe_layers=[1], host_experts=fmt).model
        moved = load_model(moe_file, progress=False, keep_quantized=keep).model
        moes = [m for m in moved.modules() if isinstance(m, MoE)]
        assert (moes[1].quant is not None) == keep and moes[1].host is None
        move_experts_to_ram(moved, read_checkpoint(moe_file), [1], fmt, torch.float32)
        assert moes[0].host is None and moes[1].host is not None and moes[1].host.fmt == fmt
        assert moes[1].path == "host" and moes[1].quant is None and moes[1].w13 is None
        assert all(p.numel() == 0 for e in moes[1].experts for p in e.parameters())
        torch.testing.assert_close(logits(moved), logits(placed), rtol=0, atol=0)


def test_a_load_beyond_the_plan_moves_the_next_layers_experts_to_ram(moe_file, monkeypatch):
    """`refit_after_load` with the load measured at the plan's weights and 1.5 expert layers more: the plan
    made again keeps the first two MoE layers' experts in RAM, and the model's layers follow it."""
    import dataclasses

    from strata.config import EngineConfig, ModelConfig
    from strata.engine import placement
    from strata.engine.startup import refit_after_load
    from strata.loaders import read_checkpoint
    from strata.memory_plan import BEYOND
    from strata.models.moe import MoE

    ckpt = read_checkpoint(moe_file)
    mc = ModelConfig.from_hf(ckpt.config)
    cfg = dataclasses.replace(EngineConfig(model=moe_file, ctx=256, parallel=1, gpu_memory=1.0, keep_quantized=True,
                                           expert_stream_tokens=0), device="cpu")
    sizes = placement.model_sizes(ckpt, mc, cfg, torch.float32, mc.num_full_attention_layers)
    layer = sizes.routed_experts[0]
    budget = (sum(b for _, b in sizes.fixed) + sizes.shared_experts + placement.scratch_bytes(cfg, mc)
              + 256 * sizes.kv_bytes_per_token + sum(sizes.routed_experts) + layer // 4)
    plan = placement.plan_placement(cfg, mc, ckpt, torch.float32, budget, mc.num_full_attention_layers, sizes=sizes)
    assert plan.cpu_moe_layers == ()
    loaded = load_model(moe_file, progress=False, keep_quantized=True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: plan.weight_bytes + 3 * layer // 2)
    refit = refit_after_load(cfg, mc, ckpt, loaded, torch.float32, sizes, plan, 0, torch.device("cpu"))
    moes = [m for m in loaded.model.modules() if isinstance(m, MoE)]
    assert refit.cpu_moe_layers == tuple(placement.moe_layers(mc)[:2]) and BEYOND in refit.table()
    assert [m.host is not None for m in moes] == [True, True]
    # Within the estimate nothing moves.
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: refit.weight_bytes)
    assert refit_after_load(cfg, mc, ckpt, loaded, torch.float32, sizes, refit, 0, torch.device("cpu")) is refit


def test_an_iq3_s_files_experts_in_ram_in_4_bits_are_its_own_weights(tmp_path):
    """IQ3_S's groups are odd multiples of a scale: compiled-int4 keeps them on that grid, so the model
    with its experts in RAM in 4 bits gives the logits of the model with them in RAM as floats (int8 rows,
    a scale per row, do not)."""
    import dataclasses

    from strata.models.moe import MoE

    mc = dataclasses.replace(shape_config("tiny-moe"), hidden_size=256, head_dim=64, moe_intermediate_size=256)
    path = str(tmp_path / "iq3s.gguf")
    write_moe(SimpleNamespace(out=path, format="IQ3_S", vocab=write_vocab_gguf(tmp_path), seed=0), mc,
              mc.num_hidden_layers)
    ids = torch.randint(0, 300, (8,), generator=torch.Generator().manual_seed(2))

    def logits(fmt):
        model = load_model(path, progress=False, host_moe_layers=[0, 1], host_experts=fmt).model
        assert all(m.host.fmt == fmt for m in model.modules() if isinstance(m, MoE))
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(8), CausalBatch(1, 8)))

    exact = logits("float")
    four = logits("compiled-int4")
    torch.testing.assert_close(four, exact, rtol=1e-4, atol=1e-4)
    int8 = logits("int8")
    assert float((int8 - exact).norm()) > 10 * float((four - exact).norm())


def _iq3s_file(tmp_path):
    import dataclasses

    mc = dataclasses.replace(shape_config("tiny-moe"), hidden_size=256, head_dim=64, moe_intermediate_size=256)
    path = str(tmp_path / "iq3s.gguf")
    write_moe(SimpleNamespace(out=path, format="IQ3_S", vocab=write_vocab_gguf(tmp_path), seed=0), mc,
              mc.num_hidden_layers)
    return path


def test_experts_kept_as_the_files_blocks_alone_are_read_by_the_kernels_and_never_by_the_cpu(tmp_path):
    """host_experts file: RAM holds the layer's blocks (the GPU's format) and no CPU copy; the fused decode
    kernels reading them where they lie (interpreted here) give the logits of the experts on the device,
    and a step those kernels do not take says the CPU cannot compute them."""
    from strata.kernels.quant.moe_q import QExpertStack
    from strata.loaders.host import host_experts_of
    from strata.models.moe import MoE

    path = _iq3s_file(tmp_path)
    kept = load_model(path, progress=False, dtype=torch.bfloat16, keep_quantized=True).model
    ids = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(2))

    def logits(model):
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(4), CausalBatch(1, 4))).float()

    on_device = logits(kept)
    model = load_model(path, progress=False, dtype=torch.bfloat16, keep_quantized=True).model
    for m in (m for m in model.modules() if isinstance(m, MoE)):
        w13, w2 = m.quant
        m.host = host_experts_of("file", w13, w2, torch.bfloat16, torch.device("cpu"), stream=True)
        assert m.host.nbytes == m.host.stream.nbytes == w13.nbytes + w2.nbytes  # the blocks, nothing more
        assert not m.host.on_cpu
        m.pcie_stacks = m.host.stream.stacks(m.host.stream.region)
        assert isinstance(m.pcie_stacks[0], QExpertStack)
        m.quant = m.qdecode = None
        m._host_ready()
    read = logits(model)
    assert float((read - on_device).norm()) <= 0.02 * float(on_device.norm())
    for m in (m for m in model.modules() if isinstance(m, MoE)):
        m.pcie_stacks = None
    with pytest.raises(RuntimeError, match="CPU cannot compute them"):
        logits(model)
    with pytest.raises(ValueError, match="needs CUDA"):
        host_experts_of("file", w13, w2, torch.bfloat16, torch.device("cpu"), stream=False)


@pytest.mark.parametrize("available,gpu,want", [
    (None, True, "compiled-int4"),           # RAM unknown: the CPU copy
    (10 * 2**30, True, "compiled-int4"),     # room for the 4-bit copy beside the blocks
    (1 * 2**20, True, "file"),               # no room: the blocks alone, for the GPU
    (1 * 2**20, False, "compiled-int4"),     # on the CPU the experts need a CPU copy all the same
])
def test_auto_keeps_the_blocks_alone_on_cuda_when_ram_cannot_hold_a_cpu_copy(tmp_path, monkeypatch, available, gpu,
                                                                              want):
    import strata.loaders.host as host
    from strata.config import ModelConfig
    from strata.kernels.host_moe import has_cpp_compiler
    from strata.loaders import read_checkpoint
    from strata.models.moe import MoE
    from strata.models.registry import build_model

    if not has_cpp_compiler():
        pytest.skip("compiled-int4 needs a C++ compiler for torch.compile")
    path = _iq3s_file(tmp_path)
    ckpt = read_checkpoint(path)
    with torch.device("meta"):
        model = build_model(ModelConfig.from_hf(ckpt.config))
    monkeypatch.setattr(host, "host_memory_available", lambda: available)
    names = host.place_host_experts(model, ckpt, [0, 1], "auto", gpu=gpu)
    assert names and {m.host_format for m in model.modules() if isinstance(m, MoE)} == {want}


def test_the_plan_counts_the_cpu_copy_of_the_experts_in_ram_beside_the_files_blocks(tmp_path, monkeypatch):
    """The memory plan's host rows: the file's blocks of the layers in RAM, then their CPU copy in the
    format the load gives them (compiled-int4 for IQ3_S where a C++ compiler is found), sized as that
    format holds them; none with `file`, or where RAM leaves no room for a copy."""
    import strata.loaders.host as host
    from strata.config import EngineConfig, ModelConfig
    from strata.engine import placement
    from strata.loaders import read_checkpoint
    from strata.memory_plan import PlanError
    from strata.models.host_experts import projection_bytes

    ckpt = read_checkpoint(_iq3s_file(tmp_path))
    mc = ModelConfig.from_hf(ckpt.config)

    def plan(host_check=True, **kw):
        cfg = EngineConfig(device="cuda", ctx=256, cpu_moe=True, gpu_memory=8.0, **kw).resolved()
        return placement.plan_placement(cfg, mc, ckpt, torch.bfloat16, 8 << 30, mc.num_full_attention_layers,
                                        host_check=host_check)

    monkeypatch.setattr(host, "host_memory_available", lambda: None)
    rows = {r.component: r for r in plan().rows}
    copy = next(r for name, r in rows.items() if name.startswith("their CPU copy"))
    fmt = host.layer_format(None, {"IQ3_S"}, mc.moe_intermediate_size, mc.hidden_size)
    assert copy.where == "cpu" and f"({fmt})" in copy.component
    e, i, h = mc.num_experts, mc.moe_intermediate_size, mc.hidden_size
    assert copy.nbytes == mc.num_hidden_layers * (projection_bytes(fmt, e, 2 * i, h) + projection_bytes(fmt, e, h, i))
    assert not any(r.component.startswith("their CPU copy") for r in plan(host_experts="file").rows)
    # RAM for the blocks but not a copy: the blocks alone (file); for neither: refused before the load.
    blocks = sum(r.nbytes for r in plan(host_experts="file").rows if r.where == "cpu")
    monkeypatch.setattr(host, "host_memory_available", lambda: int(blocks * 1.1))
    assert not any(r.component.startswith("their CPU copy") for r in plan().rows)
    monkeypatch.setattr(host, "host_memory_available", lambda: blocks // 2)
    with pytest.raises(PlanError, match="host memory is available: a larger --gpu-memory"):
        plan()
    assert plan(host_check=False).host_bytes == blocks  # made after the load, whose experts hold that RAM
    # Pipeline stages of one machine: their experts in RAM counted together.
    cfg = EngineConfig(device="cuda", ctx=256, cpu_moe=True, gpu_memory=8.0).resolved()
    monkeypatch.setattr(host, "host_memory_available", lambda: int(blocks * 0.8))
    with pytest.raises(PlanError, match="host memory is available"):
        placement.plan_stages(cfg, mc, ckpt, torch.bfloat16, ((0, 1), (1, 2)), [8 << 30] * 2, False)
