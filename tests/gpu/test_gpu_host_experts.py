"""Routed experts in host RAM on CUDA (`--cpu-moe`): fp32 greedy output identical with the experts on
the GPU, computed on the CPU, and streamed to the GPU for prompt chunks; the pinned staging and the
streaming buffers reserved at start-up, so steady decoding allocates nothing on the GPU."""

from __future__ import annotations

import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kernels.device import release_unused_memory
from strata.models.moe import MoE
from strata.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["It is a truth universally acknowledged, that", "In the beginning God created",
           "To be, or not to be:", "The list type in Python supports"]


def _greedy(**kw) -> tuple[dict[str, list[int]], LLMEngine]:
    e = LLMEngine(EngineConfig(device="cuda", dtype="float32", parallel=2, cuda_graph=False, **kw), progress=False)
    for i, p in enumerate(PROMPTS):
        e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                    SamplingParams(max_tokens=24, ignore_eos=True), time.monotonic()))
    return {rid: [t for ev in evs for t in ev.token_ids] for rid, evs in e.run_to_completion().items()}, e


def _host_moes(e: LLMEngine) -> list[MoE]:
    return [m for m in e.model.modules() if isinstance(m, MoE) and m.host is not None]


def test_fp32_greedy_identical_with_experts_on_the_gpu_on_the_cpu_and_streamed():
    on_gpu, _ = _greedy()
    on_cpu, e = _greedy(cpu_moe=True, host_experts="float", expert_stream_tokens=0)
    assert _host_moes(e) and e.expert_streamer is None
    assert on_cpu == on_gpu
    streamed, e = _greedy(cpu_moe=True, host_experts="float", expert_stream_tokens=4)
    assert e.expert_streamer is not None and e.expert_streamer.bytes_copied > 0  # the prompts were streamed
    assert streamed == on_gpu


def test_decoding_with_experts_in_ram_allocates_nothing_new():
    e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", parallel=2, cpu_moe=True), progress=False)
    for i, p in enumerate(PROMPTS[:2]):
        e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                    SamplingParams(max_tokens=64, ignore_eos=True), time.monotonic()))
    for _ in range(8):  # the prompts and the first decode steps
        e.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    reserved = torch.cuda.memory_reserved()
    steps = 0
    while e.has_work() and steps < 40:
        e.step()
        steps += 1
    torch.cuda.synchronize()
    print(f"{steps} decode steps: {torch.cuda.memory_stats()['allocation.all.allocated'] - before} GPU allocations, "
          f"reserved {reserved} -> {torch.cuda.memory_reserved()}")
    assert torch.cuda.memory_reserved() == reserved


def test_the_cap_holds_with_experts_in_ram():
    release_unused_memory()  # what earlier tests' engines left in this process counts against a cap
    torch.cuda.reset_peak_memory_stats()
    out, e = _greedy(cpu_moe=True, gpu_memory=1.5)
    assert e.memory_plan is not None and e.memory_plan.cpu_moe_layers
    assert torch.cuda.max_memory_reserved() <= 1.5 * 2**30
    assert all(len(v) == 24 for v in out.values())


def test_the_stream_threshold_is_measured_at_start_up():
    out, e = _greedy(cpu_moe=True, host_experts="float")
    moes = _host_moes(e)
    if e.expert_streamer is None:  # the CPU was faster than a copy at every step size up to a chunk
        assert all(m.stream_min_tokens == 0 for m in moes)
    else:
        assert len({m.stream_min_tokens for m in moes}) == 1 and moes[0].stream_min_tokens >= 1
        assert e.host_staging.tokens >= moes[0].stream_min_tokens - 1
    assert all(len(v) == 24 for v in out.values())


def test_graph_pieces_around_the_cpu_experts_give_the_eager_tokens():
    """--host-expert-graphs: decode steps replay graphs cut at each layer whose experts the CPU computes
    (fp32, every layer's experts in RAM, spec 2 for verification rows too); tokens identical to the
    eager steps, and the pieces were replayed."""
    from strata.runner.graph_pieces import GraphPieces

    for spec in (0, 2):
        eager, _ = _greedy(cpu_moe=True, host_experts="float", expert_stream_tokens=0, spec=spec)
        replays = {"pieces": 0}
        original = GraphPieces.replay

        def counted(self, rows=None):
            replays["pieces"] += 1
            return original(self, rows)

        GraphPieces.replay = counted
        try:
            e = LLMEngine(EngineConfig(device="cuda", dtype="float32", parallel=2, cpu_moe=True, host_experts="float",
                                       expert_stream_tokens=0, spec=spec, host_expert_graphs=True), progress=False)
            assert e.runner.graphs and all(isinstance(g.graph, GraphPieces) for g in e.runner.graphs.values())
            assert all(len(g.graph.pieces) == len(_host_moes(e)) + 1 for g in e.runner.graphs.values())
            for i, p in enumerate(PROMPTS):
                e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                            SamplingParams(max_tokens=24, ignore_eos=True), time.monotonic()))
            pieces = {rid: [t for ev in evs for t in ev.token_ids] for rid, evs in e.run_to_completion().items()}
        finally:
            GraphPieces.replay = original
        assert replays["pieces"] > 0 and pieces == eager, spec


def _decoding_grows_the_reserve_by(e: LLMEngine) -> int:
    """Two 64-token requests: bytes the CUDA allocator reserved between their eighth step and their end."""
    for i, p in enumerate(PROMPTS[:2]):
        e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                    SamplingParams(max_tokens=64, ignore_eos=True), time.monotonic()))
    for _ in range(8):
        e.step()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    while e.has_work():
        e.step()
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - reserved


def test_decoding_through_graph_pieces_allocates_nothing_new():
    # Never streamed: the embedded model's experts copy up faster than the CPU computes one row, and only
    # steps the CPU computes are captured.
    e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", parallel=2, cpu_moe=True, host_expert_graphs=True,
                               expert_stream_tokens=0, host_expert_decode="cpu"), progress=False)
    assert e.runner.graphs and _decoding_grows_the_reserve_by(e) == 0


def _bf16_greedy(**kw) -> tuple[dict[str, list[int]], LLMEngine]:
    e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", parallel=2, **kw), progress=False)
    for i, p in enumerate(PROMPTS):
        e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                    SamplingParams(max_tokens=24, ignore_eos=True), time.monotonic()))
    return {rid: [t for ev in evs for t in ev.token_ids] for rid, evs in e.run_to_completion().items()}, e


def test_bf16_tokens_identical_with_the_experts_read_over_pcie_and_on_the_gpu():
    """--host-expert-decode pcie: steps the fused decode kernels take read the experts from the pinned copy
    in RAM with the kernels that read them from the GPU's memory otherwise, and larger steps stream them
    to the grouped kernels as the GPU's own stacks feed them: the same tokens, bit for bit."""
    from strata.kernels.moe_decode import MAX_TOKENS

    on_gpu, _ = _bf16_greedy()
    read, e = _bf16_greedy(cpu_moe=True, host_experts="float", host_expert_decode="pcie",
                           expert_stream_tokens=MAX_TOKENS + 1)
    assert _host_moes(e) and all(m.pcie_stacks is not None for m in _host_moes(e))
    assert all(m.host.seconds == 0.0 for m in _host_moes(e))  # the CPU copy was never computed from
    assert read == on_gpu


def test_decode_read_over_pcie_replays_one_graph_a_step_and_allocates_nothing_new():
    from strata.kernels.moe_decode import MAX_TOKENS
    from strata.runner.graph_pieces import GraphPieces

    # The stream threshold given: measured, it is 1 on the embedded model (its layer copies up faster than
    # any step computes), every step streams, and no step is captured.
    e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", parallel=2, cpu_moe=True, host_experts="float",
                               host_expert_decode="pcie", expert_stream_tokens=MAX_TOKENS + 1), progress=False)
    assert e.runner.graphs and not any(isinstance(g.graph, GraphPieces) for g in e.runner.graphs.values())
    assert _decoding_grows_the_reserve_by(e) == 0


def test_auto_times_the_cpu_and_the_pcie_reads_at_start_up(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="strata"):
        e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", parallel=1, cpu_moe=True), progress=False)
    assert "a decode row through one layer's experts in RAM" in caplog.text
    chose = all(m.pcie_stacks is not None for m in _host_moes(e))
    assert chose or not any(m.pcie_stacks is not None for m in _host_moes(e))


def test_decode_read_over_pcie_keeps_async_scheduling_and_its_tokens():
    """No decode step waits for the host when the GPU reads the experts over PCIe, so steps are queued
    ahead as without experts in RAM: the same tokens as the same engine stepping in lockstep."""
    from strata.kernels.moe_decode import MAX_TOKENS

    kw = dict(cpu_moe=True, host_experts="float", host_expert_decode="pcie", expert_stream_tokens=MAX_TOKENS + 1)
    ahead, e = _bf16_greedy(**kw)
    assert e.cfg.async_scheduling and e.pipelined and all(m.pcie_stacks is not None for m in _host_moes(e))
    lockstep, e = _bf16_greedy(async_scheduling=False, **kw)
    assert not e.pipelined
    assert ahead == lockstep


def test_experts_shared_by_the_cpu_and_the_pcie_reads_give_one_set_of_tokens_eager_and_in_graph_pieces(monkeypatch):
    """--host-expert-decode both: of each row's chosen experts the CPU computes the first (the share
    the probe timed fastest; fixed here so both engines split alike) while the GPU reads the others over
    PCIe, in eager steps and in graph pieces whose read is a graph launched beside the host part: the
    same tokens, both parts computed, and steady decoding through the pieces allocates nothing new."""
    import strata.runner.host_offload as ho
    from strata.kernels.moe_decode import MAX_TOKENS
    from strata.runner.graph_pieces import GraphPieces

    monkeypatch.setattr(ho, "split_step_seconds", lambda host, stacks, k, c, *a: float(abs(c - 1)))
    kw = dict(cpu_moe=True, host_experts="float", host_expert_decode="both", expert_stream_tokens=MAX_TOKENS + 1)
    eager, e = _bf16_greedy(cuda_graph=False, **kw)
    moes = _host_moes(e)
    assert moes and all(m.cpu_slots == 1 and m.pcie_stacks is not None for m in moes)
    assert all(m.host.seconds > 0 for m in moes)
    pieces, e = _bf16_greedy(**kw)
    assert not e.cfg.async_scheduling
    assert e.runner.graphs and all(isinstance(g.graph, GraphPieces) for g in e.runner.graphs.values())
    assert pieces == eager
    e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", parallel=2, **kw), progress=False)
    assert _decoding_grows_the_reserve_by(e) == 0


def test_experts_kept_for_the_gpu_alone_give_the_gpu_tokens_and_stream_larger_steps():
    """--host-experts file: RAM holds only the GPU's format of the experts (no CPU copy); decode rows read
    them over PCIe, larger steps stream them (whatever the threshold), async scheduling stays: the tokens
    of the experts on the GPU, bit for bit, and steady decoding allocates nothing new."""
    on_gpu, _ = _bf16_greedy()
    read, e = _bf16_greedy(cpu_moe=True, host_experts="file")
    moes = _host_moes(e)
    assert moes and all(not m.host.on_cpu and m.pcie_stacks is not None for m in moes)
    assert e.expert_streamer is not None and e.cfg.async_scheduling
    assert read == on_gpu
    long_prompt = tuple(e.tokenizer.encode(" ".join(PROMPTS * 4)))
    assert len(long_prompt) > 32
    copied = e.expert_streamer.bytes_copied
    e.add_request(EngineRequest("long", long_prompt, SamplingParams(max_tokens=2, ignore_eos=True), time.monotonic()))
    e.run_to_completion()
    assert e.expert_streamer.bytes_copied > copied
    e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", parallel=2, cpu_moe=True, host_experts="file"),
                  progress=False)
    assert _decoding_grows_the_reserve_by(e) == 0
