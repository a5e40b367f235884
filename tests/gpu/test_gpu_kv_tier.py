"""The host KV tier on CUDA (`pytest -m gpu -s tests/gpu/test_gpu_kv_tier.py`): the host pool is pinned,
block moves go through the copier's side stream and events, the host part of decode rows is attended
on the CPU and prompt chunks stream theirs, the device part by the Triton kernels with their LSE output;
fp32 greedy output is identical with a resident window smaller than the prompt (CUDA graphs on: steps
with a host part run eagerly, or with --kv-tier-graphs replay graphs cut at each attention layer;
speculation, preemption, the concurrent read on its own stream, a hybrid model, experts in RAM), bf16 under --batch-invariant is bitwise the run without the tier, and a steady second pass adds
no allocator segment."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from strata.attention.tiered import TieredAttention
from strata.attention.triton_backend import TritonPagedAttention
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kvcache.host_pool import BlockCopier
from strata.kvcache.pool import make_pool
from strata.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TEXT = open(__file__.replace("tests/gpu/test_gpu_kv_tier.py", "strata/assets/default-model/README.md")).read()


def run(prompts, logprobs=False, **kw):
    # Decode rows on the CPU unless a test asks (auto would time both ways and may stream them).
    base = dict(device="cuda", dtype="float32", ctx=2048, parallel=2, chunk_size=128, max_num_batched_tokens=256,
                prefix_cache=False, kv_tier_decode="cpu")
    e = LLMEngine(EngineConfig(**{**base, **kw}), progress=False)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        e.add_request(EngineRequest(f"r{i}", tuple(p), params, time.monotonic()), logprobs=logprobs)
    got = e.run_to_completion()
    e.close()
    out = {rid: [t for ev in evs for t in ev.token_ids] for rid, evs in got.items()}
    if logprobs:
        out = {rid: (out[rid], [x for ev in evs for x in ev.logprobs]) for rid, evs in got.items()}
    return out, e


def prompts(e_or_none=None):
    e = LLMEngine(EngineConfig(device="cpu", ctx=256), progress=False)
    ids = e.tokenizer.encode(TEXT * 2)
    return [ids[:900], ids[1000:1500]]


@pytest.fixture
def replays(monkeypatch):
    """Counts decode-graph replays: "plain" ones, and "cut" ones (steps with a host part, which must
    replay the tier's family: cut at each attention layer, or reading the host part over PCIe)."""
    from strata.runner.model_runner import ModelRunner

    n = {"plain": 0, "cut": 0}
    launch = ModelRunner._launch_graph

    def counted(self, g, *a, **kw):
        # The reference runs have no tier: their backend has no host part to ask about.
        host = getattr(self.attn, "has_host", False)
        assert (g in self.tier_graphs.values()) == host, "a step replayed the wrong family of graphs"
        n["cut" if host else "plain"] += 1
        return launch(self, g, *a, **kw)

    monkeypatch.setattr(ModelRunner, "_launch_graph", counted)
    return n


def test_cuda_copier_is_pinned_and_event_ordered():
    dev = make_pool("int8", 2, 16, 16, 2, 64, "cuda", torch.bfloat16)
    host = make_pool("int8", 2, 16, 16, 2, 64, "cpu", torch.bfloat16, pin=True)
    assert host.k.is_pinned()
    for layer in range(2):
        dev.write(layer, torch.arange(256, device="cuda"), torch.randn(256, 2, 64, device="cuda"),
                  torch.randn(256, 2, 64, device="cuda"))
    cp = BlockCopier(dev, host, max_blocks=4)
    t = cp.start([3, 7], [1, 2])
    while not cp.ready(t):
        pass
    cp.finish(t)
    for src, dst in ((3, 1), (7, 2)):
        torch.testing.assert_close(host.k[:, dst * 16:(dst + 1) * 16], dev.k[:, src * 16:(src + 1) * 16].cpu())


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cuda_fp32_tier_identical(kv):
    ps = prompts()
    want, _ = run(ps, kv=kv)
    out, e = run(ps, kv=kv, kv_resident=128)
    assert out == want
    assert e.stats().kv_blocks_moved_total > 0 and e.host_pool.k.is_pinned()


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("way", ["stream", "pcie"])
def test_cuda_fp32_kernel_decode_rows_identical(kv, way, replays):
    """`--kv-tier-decode stream` / `pcie`: decode and verification rows attend their host part through
    the kernel, over a streamed copy or read in place from the pinned host pool, none on the CPU; the
    same tokens as without the tier. PCIe steps replay graphs of their own; streamed ones run eagerly."""
    ps = prompts()
    want, _ = run(ps, kv=kv, spec=2)
    out, e = run(ps, kv=kv, spec=2, kv_resident=128, kv_tier_decode=way)
    assert out == want
    assert (replays["cut"] > 0) == (way == "pcie") and bool(e.runner.tier_graphs) == (way == "pcie")
    attn = e.runner.attn
    assert e.runner.tier_decode == way and (attn.stream_decode, attn.pcie_decode) == (way == "stream", way == "pcie")
    assert (e.drafter.attn.stream_decode, e.drafter.attn.pcie_decode) == (attn.stream_decode, attn.pcie_decode)
    assert attn.host_rows_total > 0 and attn.host_seconds_total == 0 and not e.runner.tier_cuts


def test_cuda_auto_times_every_way_at_start_up(caplog):
    with caplog.at_level(logging.INFO, logger="strata"):
        out, e = run(prompts()[:1], kv_resident=128, kv_tier_decode="auto")
    assert e.runner.tier_decode in ("cpu", "stream", "pcie") and "host KV decode rows" in caplog.text
    assert "pcie" in caplog.text.split("host KV decode rows")[1].splitlines()[0]
    assert e.runner.attn.stream_decode == (e.runner.tier_decode == "stream")
    assert e.runner.attn.pcie_decode == (e.runner.tier_decode == "pcie")


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cuda_tier_attends_its_device_part_with_the_triton_kernels(kv, monkeypatch):
    """The tier's inner backend is the Triton one, and its `attend_lse` (the kernel's LSE output, split
    decodes and prompt chunks alike) is what the greedy run without the tier is matched by."""
    calls = {"lse": 0}
    attend_lse = TritonPagedAttention.attend_lse

    def counted(self, *a, **kw):
        calls["lse"] += 1
        return attend_lse(self, *a, **kw)

    monkeypatch.setattr(TritonPagedAttention, "attend_lse", counted)
    ps = prompts()
    want, _ = run(ps, kv=kv)
    out, e = run(ps, kv=kv, kv_resident=128)
    assert isinstance(e.runner.attn, TieredAttention) and isinstance(e.runner.attn.inner, TritonPagedAttention)
    assert e.runner.attn.host_rows_total > 0 and calls["lse"] > 0
    assert out == want


def test_cuda_fp32_tier_with_speculation_identical():
    ps = prompts()
    want, _ = run(ps)
    out, e = run(ps, kv_resident=128, spec=3, batch_mtp=True)
    assert out == want and e.drafter.split
    # One slot whose device pool is smaller than its prompt; then preemptions with blocks in both tiers.
    out, e = run(ps[:1], kv_resident=128, spec=3, parallel=1, kv_size=640)
    assert out == {"r0": want["r0"]}
    out, e = run(ps, kv_resident=128, kv_size=416, give_way=False)
    assert out == want and e.scheduler.preemptions_total > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_one_slot_reads_past_its_window_with_the_prefix_cache(graphs):
    """`strata bench kv-tier`'s configuration: one slot, the prefix cache on, int8, the default step budget,
    a prompt seven windows long: its blocks move while it reads (its device pool holds the window and two
    chunks), and the output is the one without the tier."""
    ps = prompts()[:1]
    kw = dict(parallel=1, prefix_cache=True, kv="int8", max_num_batched_tokens=None)
    want, _ = run(ps, **kw)
    out, e = run(ps, kv_resident=128, kv_tier_graphs=graphs, **kw)
    assert out == want and e.stats().kv_blocks_moved_total >= (900 - 128 - 128) // 16


def test_cuda_graphs_replay_steps_with_and_without_a_host_part(replays):
    """Graphs on with the tier and --kv-tier-graphs: a request within its window decodes by plain replays
    (the MTP calls too), the steps of requests with host blocks replay the graphs cut at each attention
    layer, their host parts on the CPU between the pieces; output identical to graphs without the tier.
    (The other tests here run such steps eagerly, the default.)"""
    ps = prompts()
    ps.append(ps[1][:40])  # within the window: never tiered
    want, _ = run(ps, spec=2)
    replays.update(plain=0, cut=0)
    out, e = run(ps, kv_resident=128, spec=2, kv_tier_graphs=True)
    assert out == want and e.runner.graphs and e.runner.tier_graphs and e.runner.attn.host_rows_total > 0
    assert replays["plain"] > 0 and replays["cut"] > 0 and e.drafter.step.graph_replays > 0


def test_cuda_tier_graphs_beside_experts_in_ram(replays):
    """The seed's mix, routed experts in RAM and a host KV part: one decode graph cut at each layer whose
    experts the CPU computes and at each attention layer; fp32 tokens identical to the same placement
    without the tier."""
    ps = prompts()
    kw = dict(cpu_moe=True, host_experts="float", expert_stream_tokens=0)
    want, _ = run(ps, **kw)
    replays.update(plain=0, cut=0)
    out, e = run(ps, kv_resident=128, kv_tier_graphs=True, **kw)
    assert out == want and replays["cut"] > 0 and e.runner.attn.host_rows_total > 0


def test_cuda_tier_beside_the_concurrent_read(monkeypatch):
    """The read stage on its own stream with its own tiered backend: a long read beside a decode."""
    ps = prompts()
    want, _ = run(ps)
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    out, e = run(ps, kv_resident=128)
    assert out == want and e.read_stage.runner.attn.host_rows_total > 0


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cuda_bf16_batch_invariant_tier_is_bitwise(tiny_model_dirs, kv):
    """--batch-invariant in bf16 (tiny dense Qwen3): each tiered sequence is assembled whole and attended by
    the invariant Triton kernel, so tokens and logprobs are bitwise those without the tier."""
    path, hf = tiny_model_dirs["qwen3"]
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (300, 120)]
    kw = dict(model=path, dtype="bfloat16", ctx=512, chunk_size=64, max_num_batched_tokens=128, kv=kv,
              batch_invariant=True, logprobs=True)
    want, _ = run(ps, **kw)
    out, e = run(ps, kv_resident=64, **kw)
    assert out == want and e.runner.attn.whole_sequences_total > 0


def test_cuda_hybrid_tier_identical(tiny_model_dirs, replays):
    """The tiny Qwen3-Next in fp32: the full-attention layer tiers, the linear-attention states stay on
    the device; decode graphs (which update the slots' states) replay, cut where a host part is."""
    path, hf = tiny_model_dirs["qwen3_next"]
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (300, 130, 20)]
    kw = dict(model=path, ctx=512, chunk_size=32, max_num_batched_tokens=64)
    want, _ = run(ps, **kw)
    replays.update(plain=0, cut=0)
    out, e = run(ps, kv_resident=64, kv_tier_graphs=True, **kw)
    assert out == want and e.runner.attn.host_rows_total > 0 and replays["cut"] > 0


def test_cuda_tier_second_pass_adds_no_segment():
    ps = prompts()
    _, e = run(ps, kv_resident=128)
    before = torch.cuda.memory_stats()["segment.all.allocated"]
    for i, p in enumerate(ps):
        e.add_request(EngineRequest(f"again{i}", tuple(p), SamplingParams(max_tokens=32, ignore_eos=True),
                                    time.monotonic()))
    e.run_to_completion()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == before
