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
