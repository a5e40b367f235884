"""Strata's models against HF transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.config import ModelConfig, RopeConfig
from strata.loaders import load_model
from strata.attention import CausalBatch
from strata.models.layers import rope_inv_freq
from strata.models.registry import build_model
from strata.runner.generator import Generator
from strata.sampling import SamplingParams
from tiny_models import ARCH_CONFIGS

REL_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_logits_match_hf(arch, tiny_model_dirs):
    path, hf = tiny_model_dirs[arch]
    lm = load_model(path)
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (2, 48))
    with torch.no_grad():
        ref = hf(ids).logits
        hidden = lm.model(ids.flatten(), torch.arange(48).repeat(2), CausalBatch(2, 48))
        ours = lm.model.compute_logits(hidden).view(2, 48, -1)
    err = rel_err(ours, ref)
    print(f"{arch}: max relative logit error {err:.2e}")
    assert err < REL_TOL


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_continuation_matches_hf(arch, tiny_model_dirs):
    path, hf = tiny_model_dirs[arch]
    lm = load_model(path)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    gen = Generator(lm.model, lm.tokenizer, 128, torch.device("cpu"), torch.float32)
    ours = gen.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True)).token_ids
    assert ours == ref


def test_cached_decode_equals_full_forward(tiny_model_dirs):
    """The K/V-cached path (prompt, then one token at a time) gives the full forward's logits."""
    path, _ = tiny_model_dirs["glm4_moe"]
    lm = load_model(path)
    ids = torch.randint(0, 320, (30,))
    gen = Generator(lm.model, lm.tokenizer, 64, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        full = lm.model.compute_logits(lm.model(ids, torch.arange(30), CausalBatch(1, 30)))
    steps = [gen._forward_last(ids[:20], 0)]
    steps += [gen._forward_last(ids[i : i + 1], i) for i in range(20, 30)]
    # A chunk in the middle: positions 20..29 again as one block with a prefix.
    chunk = gen._forward_last(ids[20:30], 20)
    assert rel_err(torch.stack(steps), full[19:30]) < REL_TOL
    assert rel_err(chunk, full[29]) < REL_TOL


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_head_matches_deepseek_v3_formula(tiny_model_dirs, tmp_path):
    """Add an MTP layer to the GLM checkpoint and check Strata's head against the DeepSeek-V3 formula,
    with HF's own decoder block as the block reference."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    src, hf = tiny_model_dirs["glm4_moe"]
    n = hf.config.num_hidden_layers
    cfg = ModelConfig.from_file(f"{src}/config.json")
    torch.manual_seed(3)
    donor = build_model(cfg, with_mtp=True)
    mtp_sd = {k: v for k, v in donor.state_dict().items() if k.startswith(f"model.layers.{n}.")}
    for k, v in mtp_sd.items():
        if k.endswith("norm.weight"):
            v.add_(0.1 * torch.randn_like(v))
        elif k.endswith("e_score_correction_bias"):
            v.normal_(0, 0.1)
        else:
            v.normal_(0, 0.05)
    tensors = load_file(f"{src}/model.safetensors")
    save_file({**tensors, **mtp_sd}, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes(open(f"{src}/{f}", "rb").read())

    lm = load_model(str(tmp_path))
    assert lm.has_mtp and len(lm.model.mtp_layers) == 1

    T = 24
    ids = torch.randint(0, cfg.vocab_size, (T + 1,))
    pos = torch.arange(T)
    with torch.no_grad():
        h_main = hf.model(ids[None, :T]).last_hidden_state[0]  # post-norm, as the MTP head takes it
        _, ours = lm.model.mtp_forward(h_main, ids[1 : T + 1], pos, CausalBatch(1, T))

        p = f"model.layers.{n}."
        eps = cfg.rms_norm_eps
        emb = tensors["model.embed_tokens.weight"][ids[1 : T + 1]]
        x = torch.cat([_rms(emb, mtp_sd[p + "enorm.weight"], eps), _rms(h_main, mtp_sd[p + "hnorm.weight"], eps)], -1)
        x = x @ mtp_sd[p + "eh_proj.weight"].T
        block = Glm4MoeDecoderLayer(hf.config, layer_idx=n).eval()
        block_sd = {k[len(p):]: v for k, v in mtp_sd.items() if not k[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))}
        block_sd = _fuse_experts(block_sd)
        block.load_state_dict(block_sd, strict=True)
        cos_sin = hf.model.rotary_emb(x[None], pos[None])
        y = block(x[None], attention_mask=None, position_ids=pos[None], position_embeddings=cos_sin)[0]
        y = y[0] if isinstance(y, tuple) else y
        ref = _rms(y, mtp_sd[p + "shared_head.norm.weight"], eps) @ tensors["lm_head.weight"].T
    err = rel_err(ours, ref)
    print(f"mtp: max relative logit error {err:.2e}")
    assert err < REL_TOL


def _fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors → the fused layout of HF's live module."""
    n = len({k.split(".")[2] for k in sd if k.startswith("mlp.experts.")})
    if n == 0:
        return sd
    out = {k: v for k, v in sd.items() if not k.startswith("mlp.experts.")}
    e = range(n)
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[f"mlp.experts.{i}.gate_proj.weight"], sd[f"mlp.experts.{i}.up_proj.weight"]]) for i in e])
    out["mlp.experts.down_proj"] = torch.stack([sd[f"mlp.experts.{i}.down_proj.weight"] for i in e])
    return out


def test_yarn_frequencies_match_hf():
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = dict(ARCH_CONFIGS["qwen3"], max_position_embeddings=131072,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
             rope_theta=1_000_000.0)
    hf_cfg = AutoConfig.for_model("qwen3", **d)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 4.0
    inv, scale = rope_inv_freq(cfg.rope, cfg.rotary_dim)
    assert torch.allclose(inv, ref_inv.float(), rtol=1e-6)
    assert math.isclose(scale, ref_scale, rel_tol=1e-9)


def test_yarn_model_at_long_positions_matches_hf(tmp_path):
    """A YaRN-scaled model evaluated at positions past the original context (256K config)."""
    from tiny_models import save_tiny_model

    hf = save_tiny_model("qwen3", str(tmp_path), max_position_embeddings=262144,
                         rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768})
    lm = load_model(str(tmp_path))
    ids = torch.randint(0, 320, (1, 16))
    pos = torch.arange(200_000, 200_016)
    with torch.no_grad():
        ref = hf(ids, position_ids=pos[None]).logits[0]
        ours = lm.model.compute_logits(lm.model(ids[0], pos, CausalBatch(1, 16)))
    assert rel_err(ours, ref) < REL_TOL


def test_rope_config_reads_both_spellings():
    old = RopeConfig.from_hf({"rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                                  "original_max_position_embeddings": 4096}})
    new = RopeConfig.from_hf({"rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 2.0,
                                                  "original_max_position_embeddings": 4096}})
    assert old == new and old.kind == "yarn" and old.theta == 5e5
