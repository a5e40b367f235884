"""The HF-directory loader: sharded checkpoints, tied heads, and a one-line error naming the file for
every bad-file case."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.loaders import LoadError, load_model
from strata.attention import CausalBatch


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _logits(lm, ids):
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(ids, torch.arange(len(ids)), CausalBatch(1, len(ids))))


def test_sharded_checkpoint_loads_like_single(tiny_model_dirs, tmp_path):
    src, _ = tiny_model_dirs["qwen3_moe"]
    tensors = load_file(f"{src}/model.safetensors")
    dst = tmp_path / "sharded"
    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{f}", dst / f)
    names = sorted(tensors)
    shards = [names[::3], names[1::3], names[2::3]]
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / fname))
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single, sharded = load_model(src), load_model(str(dst))
    a, b = single.model.state_dict(), sharded.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.arange(1, 20)
    # Same weights; only memory alignment differs, which may change the BLAS path by an ulp.
    assert torch.allclose(_logits(single, ids), _logits(sharded, ids), rtol=0, atol=1e-6)


def test_tied_embeddings(tmp_path):
    from tiny_models import save_tiny_model

    hf = save_tiny_model("qwen3", str(tmp_path), tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(f"{tmp_path}/model.safetensors")
    lm = load_model(str(tmp_path))
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    ids = torch.arange(1, 12)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert torch.allclose(_logits(lm, ids), ref, atol=1e-5)


def _rewrite(path: str, fn) -> None:
    t = load_file(f"{path}/model.safetensors")
    fn(t)
    save_file(t, f"{path}/model.safetensors")


@pytest.mark.parametrize(
    "case,expect",
    [
        ("missing", "missing tensors: model.layers.0.self_attn.q_proj.weight"),
        ("extra", "unexpected tensors: model.layers.0.self_attn.bogus.weight"),
        ("shape", "shape mismatch for model.norm.weight"),
        ("truncated", "truncated or corrupt safetensors"),
        ("corrupt", "truncated or corrupt safetensors"),
        ("unknown_arch", "unknown architecture 'llama9'"),
        ("no_config", "config.json is missing"),
        ("pickle_only", "never pickles"),
    ],
)
def test_bad_files_give_one_line_errors(case, expect, tiny_model_dirs, tmp_path):
    path = _copy(tiny_model_dirs["qwen3"][0], tmp_path / "m")
    st = f"{path}/model.safetensors"
    bad_file = path
    if case == "missing":
        _rewrite(path, lambda t: t.pop("model.layers.0.self_attn.q_proj.weight"))
    elif case == "extra":
        _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(2)}))
    elif case == "shape":
        _rewrite(path, lambda t: t.update({"model.norm.weight": torch.zeros(7)}))
    elif case == "truncated":
        data = open(st, "rb").read()
        open(st, "wb").write(data[: len(data) // 2])
        bad_file = st
    elif case == "corrupt":
        data = bytearray(open(st, "rb").read())
        data[:8] = b"\xff" * 8  # header length now absurd
        open(st, "wb").write(bytes(data))
        bad_file = st
    elif case == "unknown_arch":
        cfg = json.load(open(f"{path}/config.json"))
        cfg["model_type"] = "llama9"
        json.dump(cfg, open(f"{path}/config.json", "w"))
    elif case == "no_config":
        os.remove(f"{path}/config.json")
    elif case == "pickle_only":
        os.remove(st)
        open(f"{path}/pytorch_model.bin", "wb").write(b"\x80\x04not really")
    with pytest.raises(LoadError) as ei:
        load_model(path)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(bad_file), msg
    assert expect in msg, msg


def test_missing_path_and_unknown_format(tmp_path):
    with pytest.raises(LoadError, match="no such file"):
        load_model(str(tmp_path / "nope"))
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(LoadError, match="unknown model format"):
        load_model(str(f))
