"""Which steps the prompt-chunk CUDA graphs take (`strata.runner.prompt_graphs`): the sizes captured,
and the one-sequence, sampling, unconstrained chunk that replays the smallest graph that fits. The
replays themselves are `-m gpu` tests (tests/gpu/test_gpu_graphs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from strata.runner.prompt_graphs import PromptGraphs, prompt_graph_sizes, smallest_fitting


def test_sizes_sit_above_the_decode_graphs_and_within_a_step():
    assert prompt_graph_sizes(1, 2048) == [256, 64, 16]
    assert prompt_graph_sizes(1, 128) == [64, 16]
    assert prompt_graph_sizes(16, 2048) == [256, 64]  # 16 rows per sequence: the verify graphs hold those
    assert prompt_graph_sizes(1, 8) == []


def test_smallest_fitting():
    assert smallest_fitting([256, 64, 16], 14) == 16
    assert smallest_fitting([256, 64, 16], 16) == 16
    assert smallest_fitting([256, 64, 16], 17) == 64
    assert smallest_fitting([256, 64, 16], 257) is None


def _runner(states=None, matchers=()):
    return SimpleNamespace(rows_per_seq=1, device=torch.device("cpu"), attn=SimpleNamespace(states=states),
                           matchers=dict.fromkeys(matchers))


def _chunk(n, rid="a", sample=True, drafts=()):
    return SimpleNamespace(num_tokens=n, sample=sample, drafts=drafts, request=SimpleNamespace(request_id=rid))


def test_graph_for_takes_one_sampling_unconstrained_chunk():
    pg = PromptGraphs(_runner(), 2048)
    pg.graphs = {s: f"graph{s}" for s in pg.sizes}  # stand-ins: selection only
    assert pg.graph_for([_chunk(14)]) == "graph16"
    assert pg.graph_for([_chunk(200)]) == "graph256"
    assert pg.graph_for([_chunk(300)]) is None  # larger than every graph
    assert pg.graph_for([_chunk(14), _chunk(1, "b")]) is None  # two sequences
    assert pg.graph_for([_chunk(14, sample=False)]) is None  # the middle of a read samples nothing
    assert pg.graph_for([_chunk(4, drafts=(1, 2, 3))]) is None  # verification rows
    pg.runner = _runner(matchers=["a"])
    assert pg.graph_for([_chunk(14)]) is None  # grammar-constrained
    pg.runner = _runner(states=object())
    assert pg.graph_for([_chunk(14)]) is None  # a hybrid model's linear-attention state


def test_nothing_is_taken_without_captured_graphs():
    assert PromptGraphs(_runner(), 2048).graph_for([_chunk(14)]) is None


def test_the_engine_asks_for_solo_reads_only_where_prompt_graphs_are_captured():
    from strata.config import EngineConfig
    from strata.engine.engine import LLMEngine

    def solo(device, states=None, **cfg):
        fake = SimpleNamespace(device=torch.device(device), states=states)
        return LLMEngine._solo_read_tokens(fake, EngineConfig(**cfg))

    assert solo("cuda", max_num_batched_tokens=2048) == 256
    assert solo("cuda", max_num_batched_tokens=100) == 64
    assert solo("cuda", max_num_batched_tokens=2048, cuda_graph=False) == 0
    assert solo("cuda", max_num_batched_tokens=2048, solo_reads=False) == 0  # --no-solo-reads
    assert solo("cuda", states=object(), max_num_batched_tokens=2048) == 0  # hybrid: no prompt graphs
    assert solo("cpu", max_num_batched_tokens=2048) == 0
