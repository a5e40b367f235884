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
