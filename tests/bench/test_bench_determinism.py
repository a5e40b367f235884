"""`strata bench determinism`: the comparison catches any change, and the fp32 CPU server's answers
do not change with the batch."""

from __future__ import annotations

import json
import math

import pytest

from strata.bench.determinism import COST_FIELDS, build_prompts, compare_answers, peak_in_flight, tally
from strata.cli import main

TOKENS = ["The", " cat", " sat", " on", " the", " mat"]
LOGPROBS = [-0.5, -1.25, -2.0, -0.125, -3.5, -0.75]


def test_identical_answers_are_not_altered():
    assert compare_answers(TOKENS, LOGPROBS, list(TOKENS), list(LOGPROBS)) == {
        "altered": False, "logprobs_altered": False, "token_divergence": None, "logprob_divergence": None}


def test_a_changed_token_is_altered_at_its_position():
    other = TOKENS[:3] + [" in"] + TOKENS[4:]
    r = compare_answers(TOKENS, LOGPROBS, other, LOGPROBS)
    assert r["altered"] and not r["logprobs_altered"] and r["token_divergence"] == 3


def test_a_shorter_answer_diverges_where_it_ends():
    r = compare_answers(TOKENS, LOGPROBS, TOKENS[:4], LOGPROBS[:4])
    assert r["altered"] and r["token_divergence"] == 4 and r["logprob_divergence"] == 4


def test_one_ulp_in_one_logprob_is_caught():
    nudged = list(LOGPROBS)
    nudged[4] = math.nextafter(nudged[4], 0.0)
    r = compare_answers(TOKENS, LOGPROBS, TOKENS, nudged)
    assert not r["altered"] and r["logprobs_altered"] and r["logprob_divergence"] == 4 and r["token_divergence"] is None
    assert compare_answers(TOKENS, [0.0] * 6, TOKENS, [-0.0] * 6)["logprobs_altered"]  # bitwise, not ==


def test_tally_counts_each_kind_once():
    answers = [{"tokens": TOKENS, "logprobs": LOGPROBS}] * 3
    changed = [{"tokens": TOKENS, "logprobs": LOGPROBS}, {"tokens": TOKENS[::-1], "logprobs": LOGPROBS},
               {"tokens": TOKENS, "logprobs": LOGPROBS[:-1] + [-0.7500001]}]
    rows, altered, lp_altered = tally([5, 6, 7], answers, changed)
    assert (altered, lp_altered) == (1, 1) and [r["prompt_tokens"] for r in rows] == [5, 6, 7]
    assert abs(rows[2]["max_abs_logprob_diff"] - 1e-7) < 1e-9


def test_prompts_are_distinct_and_sized():
    prompts = build_prompts(list(range(300)), [5, 400], 5, 350)
    assert [len(p) for p in prompts] == [5, 350, 7, 350, 9]
    assert len({tuple(p) for p in prompts}) == 5 and prompts[1][0] == 97


def test_peak_in_flight():
    assert peak_in_flight([{"start": 0, "end": 2}, {"start": 1, "end": 3}, {"start": 2.5, "end": 4}]) == 2


def test_fp32_cpu_answers_do_not_change_with_the_batch(tmp_path):
    out = tmp_path / "det.json"
    assert main(["bench", "determinism", "--device", "cpu", "--dtype", "float32", "--clients", "4", "--parallel", "4",
                 "--max-tokens", "8", "--prompts", "10,150", "--chunk", "32", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["requests"] == 4 and res["altered"] == 0 and 0 <= res["logprobs_altered"] <= 4
    assert res["device"] == "cpu" and res["dtype"] == "float32" and res["peak_in_flight"] >= 2
    assert res["config"]["chunk_size"] == 32 and res["config"]["prefix_cache"] is True
    assert res["concurrent_metrics"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in res["per_request"])
    assert all(res[k] is None for k in COST_FIELDS) and res["cost_note"]
    assert [r["tokens"] for r in res["per_request"]] == [8] * 4
    assert all(r["token_divergence"] is None for r in res["per_request"])


def test_one_slot_without_the_prefix_cache_is_bitwise_identical(tmp_path):
    # The same computation twice: the harness itself must not report a difference.
    out = tmp_path / "det1.json"
    assert main(["bench", "determinism", "--device", "cpu", "--dtype", "float32", "--clients", "3", "--parallel", "1",
                 "--max-tokens", "6", "--prompts", "10,90", "--chunk", "32", "--no-prefix-cache", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["altered"], res["logprobs_altered"]) == (0, 0) and res["config"]["prefix_cache"] is False


def test_the_batch_invariant_server_gives_bitwise_equal_answers(tmp_path):
    """Batch invariance end to end on the CPU: the run of the first test (4 clients on 4 slots, chunks of 32,
    prefix cache on) with --batch-invariant: every answer's logprobs equal its run alone, bitwise."""
    out = tmp_path / "det_inv.json"
    assert main(["bench", "determinism", "--device", "cpu", "--dtype", "float32", "--clients", "4", "--parallel", "4",
                 "--max-tokens", "8", "--prompts", "10,150", "--chunk", "32", "--batch-invariant", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["batch_invariant"] is True and res["peak_in_flight"] >= 2
    assert res["alone_metrics"]["prefix_cache_hits"] >= 1  # alone reads start after the cached blocks
    assert (res["altered"], res["logprobs_altered"]) == (0, 0)


def test_the_batch_invariant_server_over_q8_0_weights(tmp_path):
    """--shape --quant Q8_0: random weights kept quantized (the CPU runs their dequantized rows through the
    padded linear); with --batch-invariant every answer equals its run alone, bitwise."""
    out = tmp_path / "det_q8.json"
    assert main(["bench", "determinism", "--shape", "tiny-256", "--quant", "Q8_0", "--device", "cpu", "--dtype",
                 "float32", "--clients", "3", "--parallel", "3", "--max-tokens", "6", "--prompts", "10,70",
                 "--chunk", "32", "--batch-invariant", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["quant"] == "Q8_0" and res["model"] == "tiny-256" and res["peak_in_flight"] >= 2
    assert (res["requests"], res["altered"], res["logprobs_altered"]) == (3, 0, 0)
    with pytest.raises(SystemExit, match="--shape"):
        main(["bench", "determinism", "--quant", "Q8_0", "--device", "cpu"])
