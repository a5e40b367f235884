"""`strata bench concurrent` end to end on the CPU at tiny sizes: the JSON has its fields, every number
is finite, nothing grew during a read, and both arms' reads gave the same tokens."""

from __future__ import annotations

import json
import math

import pytest

from strata.cli import main

SUMMARY_FIELDS = ("alloc_growth_bytes", "itl_during_over_idle", "read_beside_over_alone", "short_ttft_s",
                  "needle_correct", "needle_total", "outputs_identical", "give_ways", "stalls", "by_length", "by_arm")
ROW_FIELDS = ("read_alone_tok_s", "read_beside_tok_s", "itl_idle_50_ms", "itl_idle_99_ms", "itl_during_50_ms",
              "itl_during_99_ms", "itl_during_over_idle_p50", "itl_during_over_idle_p99", "decode_during_tok_s",
              "stalls", "read_beside_over_alone")


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


def _run(tmp_path, *extra) -> dict:
    out = tmp_path / "concurrent.json"
    assert main(["bench", "concurrent", "--device", "cpu", "--pairs", "1", "--chunk", "64", "--idle-tokens", "8",
                 "--no-plot", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _check(res: dict, lengths: list[int]) -> dict:
    assert all(math.isfinite(x) for x in _numbers(res))
    s = res["summary"]
    assert all(k in s for k in SUMMARY_FIELDS)
    assert set(s["by_arm"]) == {"concurrent", "concurrent_smb"} == {r["arm"] for r in res["runs"]}
    assert s["alloc_growth_bytes"] == 0 and s["reads_measured"] > 0
    assert s["outputs_identical"] and s["beside_first_token_matches_alone"]
    for q in ("p50", "p99"):
        assert s["itl_during_over_idle"][q] > 0
    assert s["read_beside_over_alone"] > 0 and s["short_ttft_s"] > 0
    assert s["give_ways"] >= 1  # the long read gave way to the short request
    for r in res["runs"]:
        assert [row["prompt_tokens"] for row in r["lengths"]] == lengths
        for row in r["lengths"]:
            assert all(row[k] is not None for k in ROW_FIELDS)
            assert row["decode_tokens_during"] > 0
            assert row["timeline"]["read_tokens"][-1] == row["prompt_tokens"]
    return s


def test_bench_concurrent_random_shape(tmp_path):
    # A read long enough that the short request reliably lands during it, even on a loaded CI machine.
    res = _run(tmp_path, "--shape", "tiny", "--lengths", "512", "--giveway-tokens", "3584", "--http")
    s = _check(res, [512])
    # The give-way once more through strata serve's path: the short request answered during the read.
    assert s["serve_short_ttft_s"] > 0 and s["serve_long_ttft_s"] > 0 and s["serve_give_ways"] >= 1
    assert s["serve_short_finished_first"]
    assert not res["needle"]["run"] and s["needle_total"] == 0  # random weights: no tokenizer
    assert s["drafts_accepted"] is None
    assert res["runs"][1]["env"]["STRATA_PIPED_CONCURRENT_SMB"] == "1"


def test_bench_concurrent_quantized_weights():
    """`--quant Q8_0` (the Q8_0 arm): the random weights kept quantized, the name (and so the
    default JSON) carrying the format; refused beside a checkpoint. Only the load: the read stage's
    thread and the decode thread cannot both run Triton's interpreter, which the quantized kernels
    take on the CPU here, so the bench itself runs with it on the GPU."""
    import argparse

    import torch

    from strata.bench import concurrent as bench
    from strata.models.quantize import qweights_of

    args = argparse.Namespace(model=None, quant="Q8_0", shape="tiny", seed=0)
    loaded, name = bench._load(args, torch.device("cpu"), torch.float32)
    assert name == "tiny_Q8_0" and {q.ggml_type for q in qweights_of(loaded.model)} == {"Q8_0"}
    with pytest.raises(SystemExit, match="--quant"):
        bench._load(argparse.Namespace(model="default", quant="Q8_0", shape="tiny", seed=0), torch.device("cpu"),
                    torch.float32)


def test_bench_concurrent_embedded_model_with_spec_and_needle(tmp_path):
    res = _run(tmp_path, "--model", "default", "--lengths", "320", "--spec", "2", "--needle-trials", "1")
    s = _check(res, [320])
    assert res["needle"]["run"] and s["needle_total"] == 2 and 0 <= s["needle_correct"] <= 2
    assert all(t["give_ways"] >= 1 and t["key_at"] < t["yield_at"] < t["key_at"] + t["key_tokens"]
               for nd in res["needle"]["by_arm"].values() for t in nd["trials"])
    assert s["drafts_accepted"] > 0
