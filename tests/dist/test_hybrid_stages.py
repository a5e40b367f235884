"""Pipeline stages of a hybrid model (a tiny random qwen3_next with an MTP head, fp32, CPU): each stage
keeps its own linear layers' recurrent and conv states, so 2 and 3 stages give the same greedy tokens as
one with speculation (verification rows, restores after rejected drafts), two slots in two batch groups,
a long read in chunks that gives way to a newer request, and a preemption (the state read again fresh);
and a long prompt read alone with its chunks in flight together, one per stage, each chunk's states
left on every stage by the chunk before."""

from __future__ import annotations

import json

import pytest
import torch

from strata.config import ModelConfig
from test_stages import LONG, SHORT, read_ahead, run, steps_out

# Linear, linear, full attention, twice: "1,1" gives each stage both kinds; "1,1,1" gives rank 0 linear
# layers only (its K/V pool holds no layer) and the others one of each.
LAYERS = dict(num_hidden_layers=6, full_attention_interval=3, mlp_only_layers=[2], max_position_embeddings=4096)
PROMPTS = [LONG[:400], SHORT, LONG[:250] + " And then"]


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    """The tiny checkpoint plus random `mtp.*` tensors (HF's class drops the draft head on save). The draft
    head reads the next token's embedding only and the layers' outputs are doubled: the head drafts what
    the main model would say of that token alone, so some drafts are taken and some turned down."""
    from safetensors.torch import load_file, save_file

    from strata.models.registry import build_model
    from tiny_models import save_tiny_model

    out = tmp_path_factory.mktemp("next_stages")
    save_tiny_model("qwen3_next", str(out), **LAYERS)
    conf = json.loads((out / "config.json").read_text())
    conf["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(conf))
    torch.manual_seed(4)
    donor = build_model(ModelConfig.from_hf(conf), with_mtp=True)
    mtp = {k: (0.1 if k.endswith("norm.weight") else 0.05) * torch.randn_like(v)
           for k, v in donor.state_dict().items() if k.startswith("mtp.")}
    h = conf["hidden_size"]
    mtp["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    main = load_file(str(out / "model.safetensors"))
    for k, v in main.items():
        if k.startswith("model.layers.") and any(p in k for p in ("out_proj", "o_proj", "down_proj")):
            v.mul_(2.0)
    save_file({**main, **mtp}, str(out / "model.safetensors"))
    return str(out)


def _run(path, **kw):
    return run(model=path, prompts=PROMPTS, kv_size=320, **kw)


@pytest.fixture(scope="module")
def one_stage(next_dir):
    out, e = _run(next_dir)
    s, spec = e.scheduler, e.stats().spec
    assert e.states is not None and s.give_ways_total >= 1 and s.preemptions_total >= 1
    # Drafts were both taken and turned down: the states were restored to a verification row.
    assert 0 < spec["drafts_accepted"] < spec["drafts_proposed"], spec
    return out


@pytest.mark.parametrize("split", ["1,1", "1,1,1"])
def test_hybrid_stages_give_the_tokens_of_one(next_dir, one_stage, split):
    out, e = _run(next_dir, split_mode="layer", tensor_split=split)
    assert out == one_stage
    assert e.stages.plan.world == len(split.split(",")) and e.stages.steps > 0
    # Rank 0's state pool holds its own linear layers only, its K/V pool its full-attention layers; the
    # MTP head and its K/V layer are the last stage's.
    a, b = e.stages.plan.layers
    mc = e.model_config
    linear = sum(mc.layer_is_linear(i) for i in range(a, b))
    assert e.states.conv_states.shape[0] == linear < mc.num_hidden_layers - mc.num_full_attention_layers
    assert e.pool.num_layers == b - a - linear and e.model.mtp is None


def test_each_stage_holds_only_its_layers(next_dir):
    from strata.loaders import load_model

    first = load_model(next_dir, progress=False, layers=(0, 3))
    # Rank 0: the embedding and the head (it samples), no draft head (the last stage's).
    assert first.has_mtp and first.model.mtp is None and first.model.lm_head.weight.numel() > 0
    middle = load_model(next_dir, progress=False, layers=(2, 4)).model
    # No embedding, head or draft head in the middle.
    assert middle.model.embed_tokens.weight.numel() == 0 and middle.lm_head.weight.numel() == 0
    assert middle.mtp is None and middle.num_attention_layers == 1
    m = load_model(next_dir, progress=False, layers=(3, 6)).model
    # The last stage: the draft head, with the embedding it reads the drafted tokens through and the head.
    assert m.mtp is not None and m.model.embed_tokens.weight.numel() > 0 and m.lm_head.weight.numel() > 0
    # Layers 3-5 are linear, linear, full: two states per slot, K/V for one layer and the MTP layer's.
    assert m.new_states(3).conv_states.shape[:2] == (2, 3) and m.num_attention_layers == 2
    assert [m.model.layers[i].linear_attn.linear_idx for i in (3, 4)] == [0, 1]
    assert m.model.layers[5].self_attn.kv_idx == 0 and m.mtp.layers[0].self_attn.kv_idx == 1


@pytest.fixture(scope="module")
def lone_read(next_dir):
    out, e = _run_alone(next_dir)
    assert 0 < e.stats().spec["drafts_accepted"] < e.stats().spec["drafts_proposed"]
    return out, e.stats().spec


def _run_alone(path, **kw):
    return run(model=path, prompts=[LONG[:600]], kv_size=1024, **kw)


@pytest.mark.parametrize("split", ["1,1", "1,1,1"])
def test_a_hybrid_prompts_chunks_in_flight_together_give_the_tokens_of_one(next_dir, lone_read, tmp_path,
                                                                          monkeypatch, split):
    from strata.dist.link import read_trace

    monkeypatch.setenv("STRATA_STAGE_TRACE", str(tmp_path))
    out, e = _run_alone(next_dir, split_mode="layer", tensor_split=split)
    world = e.stages.plan.world
    assert out == lone_read[0] and e.stats().spec == lone_read[1]
    read_ahead(e, "r0", world)
    assert steps_out(read_trace(str(tmp_path), 0)) == world
