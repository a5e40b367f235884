"""The batch-invariance matrix on the CPU in fp32: with `batch_invariant`, one request's tokens and logprobs (its
own and the top-5 alternatives, bitwise) are the same alone and in every busy case: other requests in
the batch at other positions, small read chunks, a give-way, a prefix-cache hit, preemption and
recompute, speculation, the concurrent read; int8 K/V as well. A seeded sampled request rides along
and must not change either. Each case checks that its situation really happened (counters), and the
last test shows the matrix can fail: without the switch the busy run differs."""

from __future__ import annotations

import random
import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.loaders import load_model
from strata.params import SamplingParams

RNG = random.Random(15)
PROMPT = [RNG.randrange(3, 300) for _ in range(70)]  # the request under test
SAMPLED = [RNG.randrange(3, 300) for _ in range(23)]  # a seeded, sampled request
OTHERS = [[RNG.randrange(3, 300) for _ in range(n)] for n in (5, 33, 20)]
SHARED = PROMPT[:32] + [RNG.randrange(3, 300) for _ in range(9)]  # caches two blocks of A's prompt
NEW = 10
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _params(sampled: bool, n: int = NEW) -> SamplingParams:
    if sampled:
        return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    """The tiny GLM-4.5 (MoE with a shared expert and group-limited routing, an MTP layer), loaded once:
    every engine here is built on it, and each sets the switch its config says."""
    return load_model(tiny_model_dirs["glm4_moe"][0], device="cpu", dtype=torch.float32, progress=False)


def _engine(model, **kw) -> LLMEngine:
    base = dict(device="cpu", dtype="float32", ctx=512, parallel=4, batch_invariant=True, prefix_cache=False)
    return LLMEngine(EngineConfig(**{**base, **kw}), progress=False, loaded=model)


def _add(e: LLMEngine, rid: str, ids, params: SamplingParams) -> None:
    e.add_request(EngineRequest(rid, tuple(ids), params, time.monotonic(), top_logprobs=5), logprobs=True)


def _results(got) -> dict:
    return {rid: ([t for ev in evs for t in ev.token_ids], [x for ev in evs for x in ev.logprobs or ()],
                  [x for ev in evs for x in ev.top_logprobs or ()]) for rid, evs in got.items()}


def _alone(model, **kw) -> dict:
    """A and the sampled request, each alone in its own engine run (one slot, whole prompts)."""
    e = _engine(model, parallel=1, **kw)
    out = {}
    for rid, ids, sampled in (("A", PROMPT, False), ("S", SAMPLED, True)):
        _add(e, rid, ids, _params(sampled))
        out |= _results(e.run_to_completion())
    e.close()
    return out


def _busy(e: LLMEngine, a_first: bool = True, others_new: int = 14) -> dict:
    """A among three other requests and the sampled one. `a_first`: A arrives first and the rest once
    its read has begun (they make it give way), else A arrives last (the newest: the first to be
    preempted). `others_new`: the others' output lengths start here."""
    others = [(f"o{i}", ids, _params(False, others_new - 3 * i)) for i, ids in enumerate(OTHERS)]
    others.append(("S", SAMPLED, _params(True)))
    first, later = ([("A", PROMPT, _params(False))], others) if a_first else (others, [("A", PROMPT, _params(False))])
    events = {}
    for rid, ids, p in first:
        _add(e, rid, ids, p)
    for ev in e.step():  # the first chunk of A's read (or the others' first steps)
        events.setdefault(ev.request_id, []).append(ev)
    for rid, ids, p in later:
        _add(e, rid, ids, p)
    for rid, evs in e.run_to_completion().items():
        events.setdefault(rid, []).extend(evs)
    e.close()
    return _results(events)


@pytest.fixture(scope="module")
def alone(model):
    return _alone(model)


def _same(got: dict, want: dict, rids=("A", "S")) -> None:
    for rid in rids:
        tokens, logprobs, top = got[rid]
        assert tokens == want[rid][0], rid
        assert logprobs == want[rid][1], rid  # bitwise: float equality
        assert top == want[rid][2], rid


def test_chunked_reads_beside_others_with_give_ways_and_a_prefix_hit(model, alone):
    e = _engine(model, chunk_size=16, prefix_cache=True)
    _add(e, "warm", SHARED, _params(False, 2))
    e.run_to_completion()
    got = _busy(e)
    assert e.scheduler.prefix_hits_total >= 1 and e.scheduler.give_ways_total >= 1
    _same(got, alone)


def test_preemption_and_recompute(model, alone):
    e = _engine(model, kv_size=12 * 16, chunk_size=32)
    got = _busy(e, a_first=False, others_new=60)
    assert e.scheduler.preemptions_total >= 1
    _same(got, alone)


def _speculation_case(device: str, dtype: torch.dtype) -> None:
    """The embedded model (it has an MTP head; the tiny one's is not saved by HF): A's verification
    rows, drafted beside others, equal its plain decode alone. Greedy only: a sampled request under
    speculation draws through rejection sampling, a different use of its seed than plain sampling."""
    embedded = load_model(None, device=device, dtype=dtype, progress=False)
    cfg = dict(device=device, dtype=str(dtype).removeprefix("torch."))
    e = _engine(embedded, parallel=1, **cfg)
    _add(e, "A", PROMPT[:40], _params(False, 6))
    want = _results(e.run_to_completion())
    e.close()
    e = _engine(embedded, spec=2, parallel=3, **cfg)
    for rid, ids, n in (("A", PROMPT[:40], 6), ("o0", OTHERS[0], 9), ("o1", OTHERS[1], 5)):
        _add(e, rid, ids, _params(False, n))
    events = e.run_to_completion()
    e.close()
    spec = events["A"][-1].spec
    assert spec and spec["drafts_proposed"] > 0, spec  # A really was verified from drafts
    _same(_results(events), want, rids=("A",))


def test_speculation():
    _speculation_case("cpu", torch.float32)


def test_concurrent_read(model, alone, monkeypatch):
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    e = _engine(model, chunk_size=32)
    assert e.read_stage is not None
    _same(_busy(e), alone)
    assert e.read_stage.reads_total >= 3  # at least A's 70 tokens, in chunks of 32, went through the stage


def test_int8_kv(model):
    _same(_busy(_engine(model, kv="int8", chunk_size=16)), _alone(model, kv="int8"))


def test_the_matrix_can_fail_without_the_switch(model):
    """The same busy run as the first case, switch off: the logprobs differ from alone (and from the
    invariant run: the switch changes the arithmetic, so `alone` is also rerun without it)."""
    got = _busy(_engine(model, chunk_size=16, batch_invariant=False))
    base = _alone(model, batch_invariant=False)
    assert got["A"][1] != base["A"][1] or got["S"][1] != base["S"][1]


# ---- on the device ------------------------------------------------------------------------------------

def _matrix(model, **cfg) -> None:
    """A dense model's matrix: alone against chunked, busy, cache-hit runs with give-ways, and against
    preemption; bitwise equal tokens and logprobs."""
    want = _alone(model, **cfg)
    e = _engine(model, chunk_size=16, prefix_cache=True, **cfg)
    _add(e, "warm", SHARED, _params(False, 2))
    e.run_to_completion()
    got = _busy(e)
    assert e.scheduler.prefix_hits_total >= 1 and e.scheduler.give_ways_total >= 1
    _same(got, want)
    e = _engine(model, kv_size=12 * 16, chunk_size=32, **cfg)
    got = _busy(e, a_first=False, others_new=60)
    assert e.scheduler.preemptions_total >= 1
    _same(got, want)
    return want


def test_dense_model(tiny_model_dirs):
    """The tiny dense Qwen3 (packed q|k|v and gate|up projections, no MoE)."""
    _matrix(load_model(tiny_model_dirs["qwen3"][0], device="cpu", dtype=torch.float32, progress=False))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_gpu_bf16_dense_matrix(tiny_model_dirs, kv):
    """The tiny dense Qwen3 in bf16 on CUDA: the matrix above (graphs on), and graphs off."""
    dense = load_model(tiny_model_dirs["qwen3"][0], device="cuda", dtype=torch.bfloat16, progress=False)
    cuda = dict(device="cuda", dtype="bfloat16", kv=kv)
    want = _matrix(dense, **cuda)
    _same(_busy(_engine(dense, cuda_graph=False, **cuda)), want)


@pytest.mark.gpu
@needs_cuda
def test_gpu_qwen3_8b_shape_rows_alone_and_in_a_batch():
    """Random weights at the Qwen3-8B shape, bf16: a greedy request (A) and a seeded sampled one (S),
    each alone and among six others (read in 2048-token chunks beside their decodes), give the same
    tokens and logprobs, bitwise."""
    from strata.bench.random_model import random_model

    loaded = random_model("qwen3-8b", "cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (3000, 40, 700, 5, 1200, 90, 2500, 17)]
    cfg = dict(device="cuda", dtype="bfloat16", ctx=4096, kv_size=8 * 4096)
    e = _engine(loaded, parallel=1, **cfg)
    want = {}
    for rid, ids, p in (("A", prompts[0], _params(False, 24)), ("S", prompts[2], _params(True, 24))):
        _add(e, rid, ids, p)
        want |= _results(e.run_to_completion())
    e.close()
    e = _engine(loaded, parallel=8, chunk_size=2048, **cfg)
    for i, ids in enumerate(prompts):
        rid, p = {0: ("A", _params(False, 24)), 2: ("S", _params(True, 24))}.get(i, (f"o{i}", _params(False, 40)))
        _add(e, rid, ids, p)
    got = _results(e.run_to_completion())
    e.close()
    _same(got, want)


@pytest.mark.gpu
@needs_cuda
def test_gpu_speculation():
    """test_speculation in bf16 on CUDA, graphs on: the verification rows equal the plain decode's."""
    _speculation_case("cuda", torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_gpu_concurrent_read(tiny_model_dirs, monkeypatch):
    """The tiny dense Qwen3 in bf16 on CUDA: A read on the concurrent read's stage (its own stream),
    chunked, beside the others' decodes, equals A alone without the stage."""
    dense = load_model(tiny_model_dirs["qwen3"][0], device="cuda", dtype=torch.bfloat16, progress=False)
    cuda = dict(device="cuda", dtype="bfloat16")
    want = _alone(dense, **cuda)
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    e = _engine(dense, chunk_size=32, **cuda)
    assert e.read_stage is not None
    _same(_busy(e), want)


# ---- weights kept quantized ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, str]:
    """The tiny dense Qwen3 (intermediate 256, so that ffn_down's rows hold Q4_K's 256-value blocks)
    as GGUF files: "q8_0" keeps every projection and the LM head in Q8_0; "q4_k" the same but ffn_down
    in Q4_K."""
    from safetensors.torch import load_file

    from gguf import GGMLQuantizationType as QT
    from test_gguf import _hf_config, write_gguf
    from tiny_models import save_tiny_model

    src = str(tmp_path_factory.mktemp("qwen3_256"))
    save_tiny_model("qwen3", src, intermediate_size=256)
    c, tensors = _hf_config(src), load_file(f"{src}/model.safetensors")
    q8 = {"output.weight": QT.Q8_0} | {f"blk.{i}.{t}.weight": QT.Q8_0 for i in range(c["num_hidden_layers"])
                                       for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                 "ffn_down")}
    q4 = q8 | {f"blk.{i}.ffn_down.weight": QT.Q4_K for i in range(c["num_hidden_layers"])}
    out = tmp_path_factory.mktemp("ggufs")
    return {name: write_gguf(out / f"{name}.gguf", c, tensors, qtypes=q) for name, q in (("q8_0", q8), ("q4_k", q4))}


def _count_quantized_rows(monkeypatch) -> list[int]:
    """Counts the rows that go through the quantized weights' invariant product (the CPU's reference)."""
    from strata.kernels.quant import invariant as k_quant_invariant

    rows, original = [], k_quant_invariant.matmul_invariant_q_ref

    def counted(x, weight, bias=None, out=None):
        rows.append(x.shape[0])
        return original(x, weight, bias, out)

    monkeypatch.setattr(k_quant_invariant, "matmul_invariant_q_ref", counted)
    return rows


def test_dense_model_fp8(tiny_model_dirs, monkeypatch):
    """`--quantize fp8` (made at load, on the CPU too): every projection an FP8 `QWeight`; the matrix
    holds through the quantized weights' invariant product."""
    from strata.models.quantize import qweights_of

    fp8 = load_model(tiny_model_dirs["qwen3"][0], device="cpu", dtype=torch.float32, progress=False, quantize="fp8")
    assert {q.ggml_type for q in qweights_of(fp8.model)} == {"FP8"}
    rows = _count_quantized_rows(monkeypatch)
    _matrix(fp8, quantize="fp8")
    assert rows


def test_dense_model_q8_0_kept_quantized(ggufs, monkeypatch):
    """A GGUF file's Q8_0 projections and LM head kept quantized: the same matrix."""
    from strata.models.quantize import qweights_of

    q8 = load_model(ggufs["q8_0"], device="cpu", dtype=torch.float32, progress=False, keep_quantized=True)
    assert {q.ggml_type for q in qweights_of(q8.model)} == {"Q8_0"} and q8.model.lm_head_q is not None
    rows = _count_quantized_rows(monkeypatch)
    _matrix(q8, keep_quantized=True)
    assert rows


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["FP8", "Q8_0"])
def test_gpu_quantized_weights_matrix(tiny_model_dirs, ggufs, fmt):
    """The matrix in bf16 on CUDA over weights kept quantized (`--quantize fp8`, a Q8_0 GGUF file's
    projections and LM head): their invariant Triton GEMM, graphs on, and graphs off."""
    from strata.models.quantize import qweights_of

    if fmt == "FP8":
        cfg = dict(quantize="fp8")
        model = load_model(tiny_model_dirs["qwen3"][0], device="cuda", dtype=torch.bfloat16, progress=False, **cfg)
    else:
        cfg = dict(keep_quantized=True)
        model = load_model(ggufs["q8_0"], device="cuda", dtype=torch.bfloat16, progress=False, **cfg)
    assert {q.ggml_type for q in qweights_of(model.model)} == {fmt}
    cuda = dict(device="cuda", dtype="bfloat16", **cfg)
    want = _matrix(model, **cuda)
    _same(_busy(_engine(model, cuda_graph=False, **cuda)), want)


def test_what_the_mode_does_not_cover_is_refused(tiny_model_dirs, ggufs):
    """Weights kept quantized in another format (Q4_K), and MoE experts kept quantized (FP8 here:
    their grouped products are not row-invariant), are refused by name."""
    q4k = load_model(ggufs["q4_k"], device="cpu", dtype=torch.float32, progress=False, keep_quantized=True)
    with pytest.raises(ValueError, match="kept quantized in Q4_K"):
        _engine(q4k, keep_quantized=True)
    moe = load_model(tiny_model_dirs["glm4_moe"][0], device="cpu", dtype=torch.float32, progress=False,
                     quantize="fp8")
    with pytest.raises(ValueError, match="MoE experts kept quantized"):
        _engine(moe, quantize="fp8")


def test_hybrid_models_are_refused(tiny_model_dirs):
    hybrid = load_model(tiny_model_dirs["qwen3_next"][0], device="cpu", dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="linear-attention"):
        _engine(hybrid)
