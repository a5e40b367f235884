"""`strata bench read|decode` on random weights: the byte/flop accounting against hand counts, and the
read, decode and HTTP arms end to end at tiny shapes on the CPU."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import torch

from strata.bench import roofline
from strata.bench.http_arm import percentile, summarize
from strata.bench.random_model import SHAPES, random_model, shape_config
from strata.bench.throughput import check_context, _draw, room_for_reads, default_out, engine_config
from strata.cli import main
from strata.config import EngineConfig
from strata.models.registry import build_model


def test_weight_bytes_match_a_hand_count_for_tiny():
    cfg = shape_config("tiny")  # V 512, H 64, I 128, 2 layers, 4 q / 2 kv heads of 16, untied head
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16  # q, k, v, o + q/k norms
    layer = attention + 2 * 64 + 3 * 64 * 128  # + two norms + gate/up/down
    for batch in (1, 3):
        params = 2 * layer + 64 + 512 * 64 + batch * 64  # + final norm + lm_head + embedding rows
        assert roofline.weight_bytes_per_step(cfg, batch, 4) == params * 4
    # K/V: 2 layers x (k + v) x 2 heads x 16 dims x 4 bytes per token.
    assert roofline.kv_bytes_per_step(cfg, 3, 10, "auto", torch.float32) == 3 * 10 * 2 * 2 * 2 * 16 * 4
    assert roofline.causal_attention_flops(cfg, 100) == 2 * 4 * 100 * 100 / 2 * 4 * 16


def test_moe_weight_bytes_count_the_experts_a_batch_activates():
    cfg = shape_config("tiny-moe")  # 8 experts, top 2, expert = 3 x 64 x 32 parameters
    assert roofline.expected_experts(8, 2, 1) == pytest.approx(2)
    assert roofline.expected_experts(8, 2, 10_000) == pytest.approx(8)
    assert 2 < roofline.expected_experts(8, 2, 2) < 4
    expert = 3 * 64 * 32
    dense = roofline.weight_bytes_per_step(cfg, 1, 2) - 2 * (2 * expert) * 2  # 2 layers x 2 experts x 2 bytes
    rows = (10_000 - 1) * 64 * 2  # embedding rows of the extra tokens
    assert roofline.weight_bytes_per_step(cfg, 10_000, 2) == pytest.approx(dense + 2 * (8 * expert) * 2 + rows)
    big = shape_config("qwen3-30b-a3b")
    active = roofline.active_params_per_token(big) + 2 * big.vocab_size * big.hidden_size
    assert 3.2e9 < active < 3.4e9  # Qwen3-30B-A3B's published 3.3B activated parameters


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_param_count_matches_the_model(shape):
    cfg = shape_config(shape)
    cfg = cfg.replace(num_hidden_layers=min(cfg.num_hidden_layers, 2))  # the layers repeat; building 48 is slow
    with torch.device("meta"):
        model = build_model(cfg)
    assert roofline.total_params(cfg) == sum(p.numel() for p in model.parameters())


def test_random_model_init():
    loaded = random_model("tiny-moe", "cpu", torch.float32, seed=1)
    sd = loaded.model.state_dict()
    assert torch.equal(sd["model.layers.0.input_layernorm.weight"], torch.ones(64))
    assert abs(float(sd["lm_head.weight"].std()) - 0.02) < 2e-3
    assert not any(p.is_meta or p.requires_grad for p in loaded.model.parameters())
    assert loaded.config.model_type == "qwen3_moe" and loaded.tokenizer is None and not loaded.model.training


def test_options_and_paths():
    args = SimpleNamespace(dtype="float32", kv="int8", no_cuda_graph=True)
    cfg = engine_config(args, torch.device("cpu"), ctx=100, parallel=4, chunk=16)
    assert (cfg.kv, cfg.kv_size, cfg.max_num_batched_tokens, cfg.chunk_size) == ("int8", 400, 16, 16)
    if "cuda_graph" in EngineConfig.__dataclass_fields__:
        assert cfg.cuda_graph is False
    assert default_out("read", "qwen3-8b", "int8", torch.device("cuda")) == "bench/results/read_qwen3-8b_int8_cuda.json"
    assert default_out("decode", "tiny", "auto", torch.device("cpu")) == "bench/results/decode_tiny_cpu.json"


def test_kernel_choice_flags_reach_the_config():
    """`strata bench decode --no-pdl --moe-decode grouped`: the choices typed go into the engine config
    (and are installed before a model is built); the others keep the config's defaults."""
    from strata.bench.throughput import add_parsers, install_kernel_choices
    from strata.kernels import choices

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    args = parser.parse_args(["decode", "--no-pdl", "--moe-decode", "grouped"])
    cfg = engine_config(args, torch.device("cpu"), ctx=100, parallel=1, chunk=16)
    assert (cfg.pdl, cfg.moe_decode, cfg.quant_decode) == (False, "grouped", "auto")
    with choices.using():
        install_kernel_choices(args)
        assert choices.current() == cfg.kernel_choices()


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_common(res: dict, hf: bool) -> None:
    c = res["ceilings"]  # measured at small sizes on the CPU
    assert _finite_positive(c["copy_gbs"]) and _finite_positive(c["gemm_tflops"])
    assert _finite_positive(res["startup_s"]) and _finite_positive(res["model_init_s"])
    assert ("hf_init_s" in res) == hf


@pytest.mark.parametrize("shape,hf", [("tiny", False), ("tiny", True), ("tiny-moe", False), ("tiny-moe", True),
                                      ("tiny-next", False)])
def test_read(tmp_path, shape, hf):
    out = tmp_path / "read.json"
    argv = ["bench", "read", "--shape", shape, "--lengths", "24,40", "--chunks", "8,32", "--device", "cpu",
            "--repeats", "1", "--out", str(out)] + ([] if hf else ["--no-hf"])
    assert main(argv) == 0
    res = json.loads(out.read_text())
    _check_common(res, hf)
    rows = res["rows"]
    assert [(r["chunk"], r["prompt_tokens"]) for r in rows] == [(8, 24), (8, 40), (32, 24), (32, 40)]
    for r in rows:
        assert _finite_positive(r["strata_tok_s"]) and _finite_positive(r["mfu"]) and r["mfu"] < 1
        assert _finite_positive(r["hf_tok_s"]) and _finite_positive(r["hf_mfu"]) if hf else r.get("hf_tok_s") is None


@pytest.mark.parametrize("shape,hf", [("tiny", False), ("tiny", True), ("tiny-moe", False), ("tiny-moe", True),
                                      ("tiny-next", False)])
def test_decode(tmp_path, shape, hf):
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--shape", shape, "--batch", "1,2", "--prompt", "8", "--tokens", "4",
            "--device", "cpu", "--repeats", "1", "--kv", "bf16", "--out", str(out)] + ([] if hf else ["--no-hf"])
    assert main(argv) == 0
    res = json.loads(out.read_text())
    _check_common(res, hf)
    assert res["kv"] == "bf16"
    rows = res["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and [r["new_tokens"] for r in rows] == [3, 6]
    cfg = shape_config(shape)
    for r in rows:
        assert r["weight_bytes_per_step"] == roofline.weight_bytes_per_step(cfg, r["batch"], 4)
        assert r["kv_bytes_per_step"] == roofline.kv_bytes_per_step(cfg, r["batch"], 8 + 4 / 2, "bf16", torch.float32)
        assert all(_finite_positive(r[k]) for k in ("strata_tok_s", "bandwidth_fraction", "strata_step_p50_ms"))
        assert r["strata_step_p50_ms"] <= r["strata_step_p99_ms"]
        assert _finite_positive(r["hf_bandwidth_fraction"]) if hf else "hf_tok_s" not in r


def test_http_arm_end_to_end(tmp_path):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--shape", "tiny", "--batch", "1", "--prompt", "8", "--tokens", "6", "--http",
                 "--no-hf", "--no-ceilings", "--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ceilings"] is None and res["rows"][0]["bandwidth_fraction"] is None
    http = res["http"]
    assert http["http_tokens"] == 6 and http["http_tokens_per_chunk"] == 1.0 and http["http_runs"] == 1
    row = res["rows"][0]
    assert _finite_positive(row["http_b1_tok_s"]) and 0 < row["http_itl_p50_ms"] <= row["http_itl_p99_ms"]
    assert [len(r["times"]) for r in http["http_raw"]] == [6, 6]  # warm-up + one measured run


def test_decode_of_the_embedded_model_writes_a_summary(tmp_path, capsys):
    """`--model default`: the embedded model at batch 1, medians of the timed runs in `summary`, the
    server's rate beside the engine's with --http."""
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model", "default", "--prompt", "32", "--tokens", "8", "--repeats", "2",
                 "--http", "--no-ceilings", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["shape"] == "default" and "hf_init_s" not in res and [r["batch"] for r in res["rows"]] == [1]
    s = res["summary"]
    assert (s["batch"], s["prompt_tokens"], s["new_tokens"], s["runs"]) == (1, 32, 7, 2)
    assert all(_finite_positive(s[k]) for k in ("decode_tok_s", "first_token_ms", "per_token_ms", "http_decode_tok_s"))
    assert s["per_token_ms"] == pytest.approx(1e3 / s["decode_tok_s"], rel=0.5)
    assert s["http_vs_engine"] == pytest.approx(s["http_decode_tok_s"] / res["rows"][0]["strata_tok_s"])
    assert default_out("decode", "default", "auto", torch.device("cpu")) == "bench/results/decode_default_cpu.json"


def test_http_summary():
    runs = [{"times": [9.0, 9.5], "completion_tokens": 2},  # warm-up: dropped
            {"times": [0.1, 0.2, 0.3, 0.5], "completion_tokens": 4},
            {"times": [0.1, 0.15, 0.2, 0.25], "completion_tokens": 4}]
    s = summarize({"client": "urllib", "runs": runs})
    assert s["http_b1_tok_s"] == pytest.approx(3 / 0.15) and s["http_runs"] == 2
    assert s["http_itl_p50_ms"] == pytest.approx(75.0) and s["http_itl_p99_ms"] == pytest.approx(195.0)
    assert percentile([1.0], 99) == 1.0 and percentile([], 50) is None


class _Axes:
    def __init__(self):
        self.bars = []

    def bar(self, pos, heights, width, label):
        self.bars.append((label, list(pos), list(heights)))

    def __getattr__(self, name):
        return lambda *a, **k: None


def test_draw_skips_missing_hf_bars():
    ax = _Axes()
    plt = SimpleNamespace(subplots=lambda **k: (None, ax))
    info = {"bench": "read", "shape": "tiny", "gpu": None, "device": "cpu", "dtype": "float32", "kv": "auto",
            "rows": [{"chunk": c, "prompt_tokens": n, "strata_tok_s": 1.0 * n, "hf_tok_s": None}
                     for c in (8, 32) for n in (24, 40)]}
    _draw(plt, info)
    assert [b[0] for b in ax.bars] == ["Strata, chunk 8", "Strata, chunk 32"]
    ax.bars.clear()
    rows = [{"batch": 1, "strata_tok_s": 5.0, "hf_tok_s": 4.0, "http_b1_tok_s": 4.5},
            {"batch": 8, "strata_tok_s": 30.0, "hf_tok_s": 20.0}]
    info = {**info, "bench": "decode", "rows": rows}
    _draw(plt, info)
    assert [(b[0], len(b[1])) for b in ax.bars] == [("Strata", 2), ("Strata over HTTP", 1), ("HF transformers", 2)]


def test_reads_may_fill_the_context():
    loaded = random_model("tiny", "cpu", torch.float32)  # max_position_embeddings 4096
    assert room_for_reads(loaded, 4000) is loaded
    roomy = room_for_reads(loaded, 4096 + 8)  # a 4096-token read
    assert roomy.config.max_position_embeddings == 4104 and roomy.model is loaded.model
    check_context(shape_config("qwen3-8b-128k"), 131072, "qwen3-8b-128k")
    with pytest.raises(ValueError, match="qwen3-8b-128k"):
        check_context(shape_config("qwen3-8b"), 131072, "qwen3-8b")


def test_server_streams_token_id_prompts_one_chunk_per_token_urllib():
    from strata.bench.http_arm import running_server
    from strata.bench.http_client import stream_once
    from strata.bench.random_model import synthetic_tokenizer, with_tokenizer
    from strata.bench.throughput import build_engine

    loaded = with_tokenizer(random_model("tiny", "cpu", torch.float32), synthetic_tokenizer(512))
    args = SimpleNamespace(dtype="float32", kv="auto", no_cuda_graph=False)
    eng, _ = build_engine(engine_config(args, torch.device("cpu"), ctx=32, parallel=1, chunk=64), loaded)
    body = {"model": "m", "prompt": [511, 0, 7, 300], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with running_server(eng, "m") as url:
        r = stream_once(url + "/v1/completions", body, "urllib")
    assert r["completion_tokens"] == 5 and len(r["times"]) == 5 and r["times"] == sorted(r["times"])


def test_results_record_the_switches_set(tmp_path, monkeypatch):
    """Every bench JSON names the STRATA_* switches its command set, and only those, and the kernel
    choices in force."""
    import json

    from strata.bench.results import save
    from strata.kernels import choices

    monkeypatch.setenv("STRATA_SPLIT_MTP_BATCH", "1")
    monkeypatch.delenv("STRATA_PIPED_CONCURRENT", raising=False)
    monkeypatch.setenv("NOT_A_STRATA_SWITCH", "1")
    out = tmp_path / "r.json"
    with choices.using(quant_decode="dp4a"):
        save({"bench": "x"}, str(out), lambda plt, info: plt.plot([0], [0]))
    got = json.loads(out.read_text())
    assert got["bench"] == "x" and got["strata_env"].get("STRATA_SPLIT_MTP_BATCH") == "1"
    assert "STRATA_PIPED_CONCURRENT" not in got["strata_env"] and "NOT_A_STRATA_SWITCH" not in got["strata_env"]
    assert got["kernel_choices"]["quant_decode"] == "dp4a" and got["kernel_choices"]["pdl"] is True
