"""`strata bench offload` pieces that run without CUDA: the eager decode on the same engine (a CPU
engine's experts in RAM stand in for a GPU engine's) and a failed request failing its arm."""

from strata.bench.offload import _host_moes, decode_eager
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine


def test_the_eager_decode_is_timed_on_the_same_engine_and_its_graphs_put_back(monkeypatch):
    e = LLMEngine(EngineConfig(device="cpu", cpu_moe=True, host_experts="int8"), progress=False)
    moes = _host_moes(e)
    assert moes and decode_eager(e, moes, 6, 0) is None  # no graphs on the CPU: nothing to compare
    marker = {1: "graphs"}
    e.runner.graphs = marker  # stands in for captured graphs; the timed decode must run without them
    seen = []
    launch = e.runner.launch
    monkeypatch.setattr(e.runner, "launch", lambda *a, **kw: seen.append(e.runner.graphs) or launch(*a, **kw))
    row = decode_eager(e, moes, 6, 0)
    assert row["decode_tok_s"] > 0 and row["cpu_expert_bytes_per_token"] > 0
    assert seen and all(g == {} for g in seen) and e.runner.graphs is marker


def test_a_failed_request_fails_the_arm_instead_of_timing_a_fast_read():
    """An out-of-memory step ends its requests with an error event at once: the bench must not time
    that as a read."""
    import pytest

    from strata.bench.offload import _generate
    from strata.engine.types import EngineEvent

    class Failing:
        def __init__(self):
            self.events = [[EngineEvent("r", (), "", finish_reason="abort", error="OutOfMemoryError: CUDA out of memory")]]

        def add_request(self, req):
            pass

        def has_work(self):
            return bool(self.events)

        def step(self):
            return self.events.pop()

    with pytest.raises(RuntimeError, match="out of memory"):
        _generate(Failing(), (1, 2, 3), 1)


def test_arms_of_one_format_load_the_model_once(monkeypatch):
    """`--formats F+cpu,F+pcie,G`: the second arm's engine starts from the first's model, G loads its own
    (the first format's model let go before it loads), and an arm after a failed one loads afresh."""
    import argparse

    import torch

    import strata.bench.offload as offload

    calls = []

    def measure(cfg, read, tokens, seed, sweep, loaded):
        calls.append((cfg.host_experts, cfg.host_expert_decode, loaded))
        if cfg.host_experts == "w8a8":
            raise RuntimeError("this arm fails")
        return {"eager": None}, f"model of {cfg.host_experts} #{len(calls)}"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(offload, "host_read_bandwidth", lambda: 1e11)
    monkeypatch.setattr(offload, "measure", measure)
    monkeypatch.setattr(offload, "write", lambda *a, **kw: None)
    p = argparse.ArgumentParser()
    offload._add_args(p)
    args = p.parse_args(["--model", "m.gguf", "--formats",
                         "int8+graphs+cpu,int8+graphs+pcie,int4,w8a8,int4+pcie,int4+cpu"])
    assert offload.run(args) == 0
    assert calls == [("int8", "cpu", None), ("int8", "pcie", "model of int8 #1"), ("int4", "auto", None),
                     ("w8a8", "auto", None), ("int4", "pcie", None), ("int4", "cpu", "model of int4 #5")]
