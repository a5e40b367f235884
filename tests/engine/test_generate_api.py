"""`strata.LLM` and `strata generate` end to end on a tiny checkpoint."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import torch

from strata import LLM, SamplingParams
from strata.cli import CLI_SAMPLING


def test_llm_generate_matches_hf_greedy(tiny_model_dirs):
    path, hf = tiny_model_dirs["qwen3_moe"]
    llm = LLM(path, device="cpu")
    outs = llm.generate(["In the beginning", "To be, or not"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(outs) == 2
    for o in outs:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(o.prompt_token_ids):].tolist()
        c = o.outputs[0]
        assert c.token_ids == ref and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)


def test_stop_and_eos_finish_reasons(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen3"][0], device="cpu")
    base = llm.generate("the", SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0]
    stop = base.text[3:6]
    assert stop
    cut = llm.generate("the", SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[: base.text.find(stop)]
    first = base.token_ids[2]
    eos = llm.generate("the", SamplingParams(max_tokens=16, stop_token_ids=[first]))[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids == base.token_ids[: base.token_ids.index(first)]


def test_seeded_sampling_is_reproducible(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["glm4_moe"][0], device="cpu")
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    a = llm.generate("the earth", p)[0].outputs[0].token_ids
    b = llm.generate("the earth", p)[0].outputs[0].token_ids
    c = llm.generate("the earth", SamplingParams(max_tokens=20, temperature=1.0, seed=43, ignore_eos=True))[0]
    assert a == b and a != c.outputs[0].token_ids


def test_chat_uses_template(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen3"][0], device="cpu")
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids[0] == llm.tokenizer.token_to_id("<|im_start|>")


def test_chat_template_is_sandboxed(tiny_model_dirs):
    from jinja2.exceptions import SecurityError

    llm = LLM(tiny_model_dirs["qwen3"][0], device="cpu")
    llm.tokenizer.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    try:
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
        raise AssertionError("sandbox let the template reach Python internals")
    except SecurityError:
        pass


def test_cli_generate_stdout_is_only_text(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"][0]
    env = {k: v for k, v in os.environ.items() if k != "STRATA_NO_PROGRESS"}
    r = subprocess.run(
        [sys.executable, "-m", "strata.cli", "generate", path, "--prompt", "In the", "--max-tokens", "10",
         "--ignore-eos", "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # Sampled as llama.cpp's CLI samples, from a random seed that stderr names.
    seed = int(re.search(r"seed: (\d+)", r.stderr)[1])
    params = dataclasses.replace(CLI_SAMPLING, max_tokens=10, seed=seed, ignore_eos=True)
    expected = LLM(path, device="cpu").generate("In the", params)[0]
    assert r.stdout == expected.outputs[0].text + "\n"
    assert "loading weights" in r.stderr and "tok/s" in r.stderr


def test_cli_reports_load_errors_on_stderr(tmp_path):
    r = subprocess.run([sys.executable, "-m", "strata.cli", "generate", str(tmp_path / "none"), "-p", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and "no such file" in r.stderr
