"""One set of engine flags for `strata generate`, `strata chat` and `strata serve` (strata.cli_args),
the `--seed` split on generate/chat, the tqdm loading bar and the benchmarks' rich summary tables."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re

import pytest

from strata import LLM, SamplingParams
from strata.cli import CLI_SAMPLING, ENGINE_DESTS, build_parser, main, resolve_engine, sampling_params
from strata.cli_args import ConfigFileError
from strata.config import EngineConfig
from strata.server.serve import resolve

PROMPT = "In the beginning"
ENGINE_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in ("generate", "chat", "serve")}


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _engine_of(command: str, argv: list[str]) -> EngineConfig:
    args = _parse(command, *argv)
    return resolve(args)[0] if command == "serve" else resolve_engine(args)


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu", ctx=256, parallel=1)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_engine_field_is_a_flag_with_the_dataclass_default(command):
    p = _subparsers()[command]
    by_dest = {a.dest: a for a in p._actions}
    dests = ENGINE_DESTS if command != "serve" else {}
    for f in ENGINE_FIELDS:
        dest = dests.get(f.name, f.name)
        action = by_dest[dest]
        assert "--" + dest.replace("_", "-") in action.option_strings, f.name
        assert action.default is argparse.SUPPRESS  # an untyped flag leaves the default (or the file) in force
        assert f"(default: {getattr(EngineConfig(), f.name)})" in action.help, f.name
    assert by_dest["model"].option_strings == []  # the positional MODEL
    extra = ["-p", "x"] if command == "generate" else []
    assert _engine_of(command, extra) == EngineConfig()


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_engine_flags_reach_the_config(command):
    seed_flag = "--seed" if command == "serve" else "--engine-seed"
    argv = ["m", "--device", "cpu", "--dtype", "float32", "--ctx", "2048", seed_flag, "3", "--parallel", "4",
            "--kv", "int8", "--kv-size", "8192", "--gpu-memory-utilization", "0.5", "--block-size", "32",
            "--chunk-size", "256", "--max-num-batched-tokens", "1024", "--no-give-way", "--max-hold-steps", "4",
            "--spec", "3", "--spec-min-p", "0.7", "--spec-adaptive", "--batch-mtp", "--batch-groups", "2",
            "--no-overlap", "--no-cuda-graph"]
    if command == "generate":
        argv += ["-p", "x"]
    cfg = _engine_of(command, argv)
    assert cfg == EngineConfig(model="m", device="cpu", dtype="float32", ctx=2048, seed=3, parallel=4, kv="int8",
                               kv_size=8192, gpu_memory_utilization=0.5, block_size=32, chunk_size=256,
                               max_num_batched_tokens=1024, give_way=False, max_hold_steps=4, spec=3,
                               spec_min_p=0.7, spec_adaptive=True, batch_mtp=True, batch_groups=2, overlap=False,
                               cuda_graph=False)
    assert _engine_of(command, ["--kv-size", "none", "--chunk-size", "None"] + (["-p", "x"] if command == "generate"
                                                                               else [])).kv_size is None


def test_seed_is_the_request_seed_and_engine_seed_the_engines():
    a = _parse("generate", "-p", "x", "--seed", "7")
    assert sampling_params(a).seed == 7 and resolve_engine(a).seed is None
    a = _parse("chat", "--engine-seed", "5")
    assert sampling_params(a).seed is None and resolve_engine(a).seed == 5
    a = _parse("generate", "-p", "x", "--seed", "7", "--engine-seed", "5")
    assert (sampling_params(a).seed, resolve_engine(a).seed) == (7, 5)
    assert resolve(_parse("serve", "--seed", "7"))[0].seed == 7  # serve has no sampling flags: --seed is the engine's


def test_generate_seed_keeps_todays_meaning(capsys, default_llm):
    argv = ["generate", "-p", PROMPT, "-n", "8", "--temperature", "1", "--ignore-eos", "--device", "cpu",
            "--ctx", "256", "--seed", "7"]
    assert main(argv) == 0
    params = dataclasses.replace(CLI_SAMPLING, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    out, err = capsys.readouterr()
    assert out == default_llm.generate(PROMPT, params)[0].outputs[0].text + "\n"
    assert "seed:" not in err  # the seed was typed


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_sample_as_llama_cpp_by_default(command):
    a = _parse(command, *(["-p", "x"] if command == "generate" else []))
    p = sampling_params(a)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == (0.8, 40, 0.95, 0.05, 1.0, None)
    assert SamplingParams().temperature == 0.0  # the API's default stays greedy; the server has OpenAI's


def test_generate_prints_the_random_seed_that_repeats_it(capsys, default_llm):
    argv = ["generate", "-p", PROMPT, "-n", "12", "--ignore-eos", "--device", "cpu", "--ctx", "256"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    seed = int(re.search(r"seed: (\d+) \(--seed \1 repeats this run", err)[1])
    params = dataclasses.replace(CLI_SAMPLING, max_tokens=12, seed=seed, ignore_eos=True)
    assert out == default_llm.generate(PROMPT, params)[0].outputs[0].text + "\n"
    assert main(argv + ["--seed", str(seed)]) == 0
    again, err = capsys.readouterr()
    assert again == out and "seed:" not in err
    assert main(argv + ["--temperature", "0"]) == 0  # greedy: no randomness, no seed
    greedy, err = capsys.readouterr()
    want = default_llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0].text
    assert greedy == want + "\n"
    assert "seed:" not in err
    assert main(argv + ["--engine-seed", "3"]) == 0  # the engine's seed seeds the request: none is drawn
    assert "seed:" not in capsys.readouterr().err


def test_generate_with_spec_prints_only_text_on_stdout(capsys, default_llm):
    argv = ["generate", "-p", PROMPT, "--spec", "2", "--batch-mtp", "--max-tokens", "8", "--device", "cpu",
            "--ctx", "256", "--temperature", "0"]
    cfg = resolve_engine(_parse(*argv))
    assert (cfg.spec, cfg.batch_mtp) == (2, True)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    greedy = default_llm.generate(PROMPT, SamplingParams(max_tokens=8))[0].outputs[0].text
    assert out == greedy + "\n"  # greedy speculation keeps the output
    assert "spec=2 batch_mtp=True" in err and "drafts:" in err and "tok/s" in err


def test_generate_reads_engine_keys_from_a_config_file(tmp_path, capsys):
    path = tmp_path / "strata.json"
    # A `strata serve` file: its server keys (port) are skipped here; `seed` is the engine's.
    path.write_text(json.dumps({"spec": 1, "kv-size": 2048, "seed": 5, "port": 9000, "device": "cpu", "ctx": 256}))
    cfg = resolve_engine(_parse("generate", "-p", "x", "--config", str(path), "--kv-size", "4096"))
    assert (cfg.spec, cfg.kv_size, cfg.seed, cfg.device) == (1, 4096, 5, "cpu")  # the typed flag wins
    assert main(["generate", "-p", PROMPT, "-n", "2", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "spec=1" in err and "kv_size=2048" in err and "seed=5" in err
    path.write_text(json.dumps({"spec": 1, "spek": 2}))
    with pytest.raises(ConfigFileError, match="unknown key 'spek'"):
        resolve_engine(_parse("chat", "--config", str(path)))
    assert main(["generate", "-p", PROMPT, "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "unknown key 'spek'" in err


def test_bad_engine_values_are_errors(capsys):
    with pytest.raises(SystemExit):
        _parse("generate", "-p", "x", "--spec", "many")
    assert main(["generate", "-p", "x", "--batch-groups", "2", "--device", "cpu"]) == 2  # > parallel
    assert "batch_groups" in capsys.readouterr().err


def test_loading_bar_is_tqdm_on_stderr(monkeypatch, capsys):
    from tqdm import tqdm

    from strata.loaders import _Progress

    monkeypatch.delenv("STRATA_NO_PROGRESS", raising=False)
    bar = _Progress(3, "loading weights")
    for _ in range(3):
        bar.advance()
    out, err = capsys.readouterr()
    assert out == "" and "loading weights" in err and "3/3" in err and isinstance(bar.bar, tqdm)
    monkeypatch.setenv("STRATA_NO_PROGRESS", "1")
    bar = _Progress(3, "loading weights")
    bar.advance(3)
    assert capsys.readouterr() == ("", "")


def _render(tables) -> str:
    from strata.bench.results import print_tables

    buf = io.StringIO()
    print_tables(tables, file=buf)
    return buf.getvalue()


def test_bench_summary_tables_render():
    from strata.bench import kv_quality, spec, throughput

    read = {"bench": "read", "shape": "tiny", "device": "cpu", "dtype": "float32", "kv": "auto", "gpu": None,
            "rows": [{"chunk": 512, "prompt_tokens": 32, "strata_tok_s": 1234.5, "mfu": 0.25, "hf_tok_s": 617.25,
                      "hf_mfu": 0.125}]}
    text = _render(throughput.summary_tables(read))
    assert "read: tiny on cpu" in text and "1234.5" in text and "2.00" in text and "hf mfu" in text
    decode = {**read, "bench": "decode", "kv": "int8",
              "rows": [{"batch": 8, "new_tokens": 56, "strata_tok_s": 99.0, "strata_step_p50_ms": 1.5,
                        "strata_step_p99_ms": 2.5, "bandwidth_fraction": None, "hf_tok_s": None}]}
    text = _render(throughput.summary_tables(decode))
    assert "KV int8" in text and "step p99 ms" in text and "2.50" in text
    assert "hf tok/s" not in text and "bandwidth" not in text  # nothing measured, no column
    info = {"parallel": 2, "device": "cpu", "dtype": "float32", "gpu": None,
            "decode": [{"spec": 0, "spec_min_p": 0.0, "decode_tok_s": 10.0, "acceptance": 0.0,
                        "mean_accepted_length": 1.0, "drafts_proposed": 0, "identical_to_spec0": True},
                       {"spec": 2, "spec_min_p": 0.7, "decode_tok_s": 15.0, "acceptance": 0.625,
                        "mean_accepted_length": 2.25, "drafts_proposed": 40, "identical_to_spec0": True}],
            "groups": [{"spec": 3, "batch_groups": 2, "overlap": True, "decode_tok_s": 12.0,
                        "identical_to_spec0": False}],
            "read": [{"split_mtp_batch": True, "prompt_tokens": 300, "read_tok_s": 800.0, "acceptance": 0.5,
                      "mean_accepted_length": 1.5}]}
    text = _render(spec.summary_tables(info))
    assert "spec decode" in text and "0.625" in text and "batch groups" in text and "False" in text
    assert "STRATA_SPLIT_MTP_BATCH" in text and "800.0" in text
    kv = {"device": "cpu", "dtype": "float32", "reference_pool": "auto",
          "models": {"default": {"positions": 256, "top1_agreement": 0.99609375, "kl_mean": 1.5e-4, "kl_max": 0.02,
                                 "seconds": 1.0}}}
    text = _render(kv_quality.summary_tables(kv))
    assert "default" in text and "0.9961" in text and "1.50e-04" in text


def test_wide_tables_are_not_folded_off_a_terminal():
    from strata.bench.results import summary_table

    cols = [(f"column number {i}", f"k{i}", ".1f") for i in range(12)]
    text = _render([summary_table("wide", cols, [{f"k{i}": float(i) for i in range(12)}])])
    assert "column number 11" in text  # one header line each, not folded to 80 columns


def test_readme_lists_every_switch():
    """Each STRATA_* switch of strata/env.py is in the README's table (a new switch must be documented)."""
    from pathlib import Path

    from strata.env import ENV

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    missing = [s.name for s in ENV.switches() if f"`{s.name}`" not in readme]
    assert not missing, f"README.md does not list {missing}"
