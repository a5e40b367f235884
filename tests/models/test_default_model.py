"""The embedded default model: ships in the package, loads fast, runs through every path."""

from __future__ import annotations

import os
import re
import time

import torch

from strata import LLM, SamplingParams
from strata.loaders import default_model_path, load_model
from strata.attention import CausalBatch

PATH = default_model_path()


def test_ships_small_with_mtp_and_loads_fast():
    assert os.path.getsize(os.path.join(PATH, "model.safetensors")) <= 20 * 1024 * 1024
    t0 = time.perf_counter()
    lm = load_model(None)
    seconds = time.perf_counter() - t0
    print(f"default model loaded in {seconds:.2f}s")
    assert seconds < 5
    assert lm.config.model_type == "glm4_moe" and lm.config.is_moe and lm.has_mtp
    assert lm.config.max_position_embeddings >= 4096
    n_params = sum(p.numel() for p in lm.model.parameters())
    assert 6e6 <= n_params <= 10e6


def test_hf_transformers_loads_the_base_model():
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    lm = load_model(PATH)
    ids = lm.tokenizer.encode("And God said, Let there be light: and there was light.")
    x = torch.tensor(ids)
    with torch.no_grad():
        ref = hf(x[None]).logits[0]
        ours = lm.model.compute_logits(lm.model(x, torch.arange(len(ids)), CausalBatch(1, len(ids))))
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_generates_english_like_text():
    llm = LLM(device="cpu")
    text = llm.generate("It is a truth universally acknowledged, that", SamplingParams(max_tokens=40))[0].outputs[0].text
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 20, text
    common = {"the", "and", "of", "to", "a", "is", "it", "that", "in", "not", "i", "be", "he", "you", "my"}
    assert sum(w.lower() in common for w in words) >= 5, text


def test_retrieves_a_pass_key():
    from strata.data.retrieval import make_retrieval_example

    llm = LLM(device="cpu")
    here = os.path.dirname(__file__)
    filler = open(os.path.join(here, "..", "..", "strata", "assets", "default-model", "README.md")).read()
    hits = 0
    for seed in range(3):
        ex = make_retrieval_example(llm.tokenizer, filler, 512, 0.5, kind="passkey", seed=f"test/{seed}")
        out = llm.generate(ex.prompt, SamplingParams(max_tokens=ex.answer_tokens))[0].outputs[0]
        hits += out.text.strip() == ex.answer.strip()
    assert hits >= 2
