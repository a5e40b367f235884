"""`strata bench offload`'s decode variants on one engine (the experts in RAM of a CPU engine stand in
for a GPU engine's: the bench itself needs CUDA)."""

from strata.bench.offload import _host_moes, decode_variants
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.models.host_experts import ExpertWorkers


def test_decode_variants_time_the_expert_threads_on_the_same_engine_and_put_it_back(monkeypatch):
    e = LLMEngine(EngineConfig(device="cpu", cpu_moe=True, host_experts="int8"), progress=False)
    moes = _host_moes(e)
    assert moes and all(m.host.workers is None for m in moes)
    calls = []
    real = ExpertWorkers.map
    monkeypatch.setattr(ExpertWorkers, "map", lambda self, fn, items: calls.append(1) or real(self, fn, items))
    rows = decode_variants(e, moes, 6, 0, workers=2)
    # No graphs on the CPU: one other way, the experts side by side on 2 threads, and it ran through them.
    assert [(r["graphs"], r["workers"]) for r in rows] == [(False, 2)]
    assert rows[0]["decode_tok_s"] > 0 and rows[0]["cpu_expert_bytes_per_token"] > 0 and calls
    assert all(m.host.workers is None for m in moes) and e.runner.graphs == {}
    assert decode_variants(e, moes, 6, 0, workers=0) == []


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
