"""The benchmark commands run end to end at tiny shapes on the CPU and write their JSON."""

from __future__ import annotations

import json

import pytest

from strata.cli import main


def test_bench_read_and_decode_write_json(tmp_path):
    out = tmp_path / "read.json"
    assert main(["bench", "read", "--shape", "tiny", "--lengths", "32,64", "--device", "cpu", "--repeats", "1",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompt_tokens"] for r in rows] == [32, 64] and all(r["strata_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in rows)
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--shape", "tiny", "--batch", "1,2", "--prompt", "8", "--tokens", "4",
                 "--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and rows[1]["new_tokens"] == 6


def test_bench_read_and_decode_on_weights_kept_quantized(tmp_path):
    """--quant: the random weights kept quantized (a GGUF format) or made FP8 at load; Strata only."""
    from strata.bench.throughput import default_out

    out = tmp_path / "decode_q8.json"
    assert main(["bench", "decode", "--shape", "tiny-256", "--quant", "Q8_0", "--no-hf", "--batch", "1",
                 "--prompt", "8", "--tokens", "4", "--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["quant"] == "Q8_0" and res["rows"][0]["new_tokens"] == 3 and res["rows"][0]["strata_tok_s"] > 0
    out = tmp_path / "read_fp8.json"
    assert main(["bench", "read", "--shape", "tiny-256", "--quant", "FP8", "--no-hf", "--lengths", "32",
                 "--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["quant"] == "FP8"
    with pytest.raises(SystemExit, match="--no-hf"):
        main(["bench", "read", "--shape", "tiny-256", "--quant", "FP8", "--device", "cpu"])
    import torch

    assert default_out("decode", "qwen3-8b", "int8", torch.device("cuda"), "Q8_0") == \
        "bench/results/decode_qwen3-8b_Q8_0_int8_cuda.json"


def test_bench_kv_reports_agreement(tmp_path):
    out = tmp_path / "kv.json"
    assert main(["bench", "kv", "--device", "cpu", "--max-tokens", "256", "--window", "128", "--chunk", "64",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for name, r in res["models"].items():
        assert 0.9 <= r["top1_agreement"] <= 1.0 and r["kl_mean"] >= 0, name


def test_bench_spec_arms_agree(tmp_path):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--device", "cpu", "--specs", "0,2", "--min-ps", "0,0.7", "--tokens", "8",
                 "--parallel", "2", "--read-tokens", "300", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["spec"], r["spec_min_p"]) for r in res["decode"]] == [(0, 0.0), (2, 0.0), (2, 0.7)]
    assert all(r["identical_to_spec0"] for r in res["decode"])
    assert res["decode"][1]["drafts_proposed"] > 0
    assert [r["split_mtp_batch"] for r in res["read"]] == [False, True]
    assert all(r["read_tok_s"] > 0 and r["acceptance"] > 0 for r in res["read"])
    groups = [(r["spec"], r["batch_groups"], r["overlap"]) for r in res["groups"]]
    assert groups == [(s, g, o) for s in (0, 3) for g, o in ((1, False), (2, True), (2, False))]
    assert all(r["identical_to_spec0"] for r in res["groups"])


def test_bench_prefix_on_a_random_shape(tmp_path):
    """--shape: random weights and a token-id conversation; the cached arm reuses all but the last
    partial block of turn 2's prompt and answers as the cold one."""
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--shape", "tiny", "--device", "cpu", "--tokens", "200", "--reply", "8",
                 "--repeats", "2", "--chunk", "64", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    cold, warm = res["arms"]
    assert res["shape"] == "tiny" and res["same_answers"]
    assert cold["cached_tokens"] == 0 and warm["turn2_prompt_tokens"] == 200 + 8 + 14
    assert warm["turn2_prompt_tokens"] - 16 <= warm["cached_tokens"] < warm["turn2_prompt_tokens"]


def test_bench_prefix_busy_adds_the_no_solo_arm(tmp_path):
    """--busy: another request decodes throughout turn 2 (two slots); a third arm turns solo reads off.
    On the CPU nothing is solo (no prompt graphs), and every arm answers turn 2 alike (fp32)."""
    out = tmp_path / "prefix_busy.json"
    assert main(["bench", "prefix", "--shape", "tiny", "--device", "cpu", "--tokens", "200", "--reply", "8",
                 "--repeats", "1", "--chunk", "64", "--busy", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["busy"] and [(a["prefix_cache"], a["solo_reads"]) for a in res["arms"]] == [
        (False, True), (True, True), (True, False)]
    assert all(a["busy"] and a["solo_reads_total"] == 0 for a in res["arms"])
    assert res["same_answers"] and res["arms"][2]["answers"] == res["arms"][1]["answers"]
    assert "ttft_ratio_no_solo" in res and res["arms"][1]["cached_tokens"] > 0


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # Triton's interpreter
def test_bench_quant_rows(tmp_path):
    """Each format's random model loads as QWeights, decodes and reads; quantized weights take fewer
    bytes than the float model's (the CPU runs the kernels in Triton's interpreter)."""
    out = tmp_path / "quant.json"
    assert main(["bench", "quant", "--shape", "tiny-256", "--formats", "bf16,Q8_0,FP8", "--device", "cpu", "--prompt",
                 "4", "--tokens", "2", "--read-tokens", "16", "--chunk", "16", "--repeats", "1", "--out", str(out)]) == 0
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bf16", "Q8_0", "FP8"}
    assert rows["Q8_0"]["weights_gib"] < rows["bf16"]["weights_gib"]
    assert rows["FP8"]["weights_gib"] < rows["bf16"]["weights_gib"]
    assert all(r["decode_b1_tok_s"] > 0 and r["read_16_tok_s"] > 0 for r in rows.values())
    assert rows["bf16"]["decode_vs_bf16"] == 1.0


def test_bench_quant_kl_orders_formats(tmp_path):
    """Q8_0 moves the embedded model's next-token distributions less than Q4_K, and neither not at all."""
    out = tmp_path / "kl.json"
    assert main(["bench", "quant-kl", "--formats", "Q8_0,Q4_K,FP8", "--tokens", "256", "--ctx", "128",
                 "--out", str(out)]) == 0
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert 0 < rows["Q8_0"]["kld"] < rows["Q4_K"]["kld"] < 0.5
    assert rows["Q8_0"]["same_top"] > 0.9 and rows["Q8_0"]["tokens"] == 256
    # FP8 (weights and activations) touches the embedded model's attention and dense MLP only.
    assert 0 < rows["FP8"]["kld"] < 0.05 and 0 < rows["FP8"]["quantized_share"] < 1


def test_quant_kl_quantizes_the_stacks_the_experts_run_from():
    """The weights a format's arm rounds are the ones the forward reads: a MoE layer's stacked experts, of
    which its experts' projections are views (a deep copy of the model would part them)."""
    import torch

    from strata.bench.quant_kl import quantize_linears
    from strata.loaders import load_model
    from strata.models.moe import MoE

    model = load_model(None, device="cpu", dtype=torch.float32, progress=False).model
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    before = moe.w13.clone()
    quantize_linears(model, "Q8_0")
    assert not torch.equal(before, moe.w13)
    inter = moe.experts[0].gate_proj.weight.shape[0]
    assert torch.equal(moe.w13[0, :inter], moe.experts[0].gate_proj.weight)


def test_bench_quant_kl_scores_experts_in_ram_against_the_files_weights(tmp_path):
    """T>host:F: compiled-int4 keeps Q4_0's groups on their own grid (no distance from the Q4_0 model);
    int8 rows, a scale per row, move it."""
    out = tmp_path / "kl.json"
    assert main(["bench", "quant-kl", "--formats", "Q4_0>host:compiled-int4,Q4_0>host:compiled", "--tokens", "256",
                 "--ctx", "128", "--out", str(out)]) == 0
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert abs(rows["Q4_0>host:compiled-int4"]["kld"]) < 1e-6 and rows["Q4_0>host:compiled-int4"]["same_top"] == 1.0
    assert rows["Q4_0>host:compiled"]["kld"] > 1e-5
    with pytest.raises(SystemExit, match="host:F"):
        main(["bench", "quant-kl", "--formats", "Q4_0>Q8_0", "--tokens", "64", "--out", str(out)])


def test_bench_kv_tier_moves_blocks_and_hits_the_host_prefix(tmp_path):
    out = tmp_path / "kv_tier.json"
    assert main(["bench", "kv-tier", "--device", "cpu", "--context", "1200", "--resident", "256", "--decode", "8",
                 "--profile", "--kv-tier-graphs", "--out", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["tier"]["blocks_moved"] > 0
    # The second request finds all but the last block of the prompt, from the host tier.
    assert info["tier"]["host_prefix_cached_tokens"] >= 1200 - 16
    # Every decode step attends a host part: its time on the CPU is counted, and is part of the step's.
    assert 0 < info["tier"]["decode_host_attention_s_per_token"] < 1 / info["tier"]["decode_tok_s"]
    assert set(info["summary"]) >= {"decode_1k_over_all_gpu", "host_prefix_ttft_over_reread", "alloc_growth_bytes"}


def test_bench_kv_tier_refuses_a_context_past_the_shape():
    with pytest.raises(SystemExit, match="holds 40960 positions"):
        main(["bench", "kv-tier", "--device", "cpu", "--shape", "qwen3-8b", "--context", "131072"])


def test_bench_kv_tier_on_a_model_file_with_the_tier_arm_alone(tmp_path):
    """The seed's run: a model file, two slots, the tier arm only, llama-server's timings beside it; a
    hybrid model (no prefix cache) leaves the host-prefix figures out instead of timing a re-read."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    from tiny_models import save_tiny_model

    model = tmp_path / "next"
    save_tiny_model("qwen3_next", str(model))
    peer = tmp_path / "llama_server.json"
    peer.write_text(json.dumps({"content": "", "timings": {"prompt_n": 440, "prompt_per_second": 50.0,
                                                            "predicted_n": 8, "predicted_per_second": 4.0}}))
    out = tmp_path / "kv_tier.json"
    assert main(["bench", "kv-tier", "--device", "cpu", "--model", str(model), "--arms", "tier", "--parallel", "2",
                 "--context", "440", "--resident", "64", "--decode", "8", "--llamacpp", str(peer),
                 "--out", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["all_device"] is None and info["parallel"] == 2 and info["tier"]["blocks_moved"] > 0
    s = info["summary"]
    assert s["decode_1k_over_all_gpu"] is None and s["host_prefix_ttft_over_reread"] is None
    assert s["decode_1k_over_llamacpp_nkvo"] == pytest.approx(info["tier"]["decode_tok_s"] / 4.0)
    assert s["read_1k_over_llamacpp_nkvo"] == pytest.approx(info["tier"]["read_tok_s"] / 50.0)
    assert not s["read_1k_over_llamacpp_nkvo_is_lower_bound"]
    # llama-server's read given up part way: its rate so far bounds the read ratio; no decode ratio.
    peer.write_text(json.dumps({"partial": True, "prompt_tokens": 440, "prompt_tokens_read": 256, "read_s": 8.0,
                                "read_tok_s": 32.0, "progress": 0.58, "decode_tok_s": None}))
    assert main(["bench", "kv-tier", "--device", "cpu", "--model", str(model), "--arms", "tier", "--context", "440",
                 "--resident", "64", "--decode", "4", "--llamacpp", str(peer), "--out", str(out)]) == 0
    info = json.loads(out.read_text())
    s = info["summary"]
    assert s["decode_1k_over_llamacpp_nkvo"] is None and s["read_1k_over_llamacpp_nkvo_is_lower_bound"]
    assert s["read_1k_over_llamacpp_nkvo"] == pytest.approx(info["tier"]["read_tok_s"] / 32.0)
    assert info["llamacpp_nkvo"]["prompt_tokens_read"] == 256
    with pytest.raises(SystemExit, match="--model or --shape"):
        main(["bench", "kv-tier", "--device", "cpu", "--model", str(model), "--shape", "tiny-moe"])
