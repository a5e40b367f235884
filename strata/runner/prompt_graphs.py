"""CUDA graphs for one sequence's short prompt chunk: a prefix-cache hit's next turn, or a short request
(a chat's next turn: its first token in a fraction of the cold read). Beside decoding slots the scheduler gives
such a read a step of its own so that it can take them (`SchedulerConfig.solo_read_tokens`).

A step that reads 14 new tokens after 3,648 cached ones does a decode step's work, but eagerly it is
hundreds of kernel launches from Python: 34.6 ms on the H200 against 4.7 ms for a graph-replayed decode step
(`bench/results/prefix_qwen3-8b_cuda.json`). So the runner also captures, for one sequence, graphs of
PROMPT_GRAPH_ROWS rows; a lone sampling prompt chunk of up to that many tokens replays the smallest that
fits. Padding rows are the decode graphs' (token 0 at position 0 into the padding slot, outside every
sequence's rows), and the head computes the logits of the chunk's last row alone (`d_last` picks it),
so the graph's outputs have one row whatever its size.

Not served by these graphs (they run eagerly, as before): steps with more than one sequence, chunks
with drafts (the decode/verify graphs take those), grammar-constrained requests, hybrid models (their
linear-attention state is laid out per step), chunks that do not sample (the middle of a read), and
chunks of a sequence with blocks in the host KV tier.
"""

from __future__ import annotations

import torch

from strata.runner.steps import BucketGraphs, LaunchedStep, capture_bucket

PROMPT_GRAPH_ROWS = (16, 64, 256)


def prompt_graph_sizes(rows_per_seq: int, max_num_batched_tokens: int) -> list[int]:
    """The sizes worth capturing, largest first: above what the decode graphs hold, within a step."""
    return sorted((r for r in PROMPT_GRAPH_ROWS if rows_per_seq < r <= max_num_batched_tokens), reverse=True)


def smallest_fitting(sizes, num_tokens: int) -> int | None:
    return min((s for s in sizes if s >= num_tokens), default=None)


class PromptGraphs:
    """The prompt-chunk graphs of one `ModelRunner` (which owns the buffers they read and write)."""

    def __init__(self, runner, max_num_batched_tokens: int):
        self.runner = runner
        self.sizes = prompt_graph_sizes(runner.rows_per_seq, max_num_batched_tokens)
        self.graphs: dict[int, BucketGraphs] = {}
        self.d_last = torch.zeros(1, dtype=torch.long, device=runner.device)  # the chunk's last row
        self.replays = 0  # tests and benchmarks read it

    @property
    def max_rows(self) -> int:
        return max(self.sizes, default=0)

    def _body(self, rows: int):
        r = self.runner
        hidden = r.model(r.d_ids[:rows], r.d_pos[:rows], r.attn)
        return hidden, *r._head_body(hidden.index_select(0, self.d_last))

    def capture(self, pool, stream: torch.cuda.Stream) -> int:
        """Capture one graph per size on the decode graphs' pool and side stream; returns how many."""
        r = self.runner
        if r.attn.states is not None:
            return 0  # hybrid models: `graph_for` never takes these graphs (module docstring)
        for rows in self.sizes:
            # One sequence reading `rows` tokens at the start of the padding block (slot 0), as the
            # decode graphs' capture layout: nothing that matters is written.
            r.h_ids[:rows] = 0
            r.h_pos[:rows] = torch.arange(rows)
            r.h_slots[:rows] = 0
            r.h_tables[:1] = 0
            r.h_meta[0, 0], r.h_meta[1, 0], r.h_meta[2, 0] = 0, rows, rows
            self.d_last.fill_(rows - 1)
            r._upload(rows, 1)
            r.attn.set_layout(r.d_slots[:rows], r.d_tables[:1], 1, rows, r.max_model_len)
            self.graphs[rows] = capture_bucket(self._body, rows, 1, pool, stream, r.device)
        return len(self.graphs)

    def graph_for(self, chunks) -> BucketGraphs | None:
        if not self.graphs or len(chunks) != 1:
            return None
        ch, r = chunks[0], self.runner
        if not ch.sample or ch.drafts or r.attn.states is not None or ch.request.request_id in r.matchers:
            return None
        if getattr(r.attn, "has_host", False):  # the host KV tier's part of the step: attended eagerly
            return None
        size = smallest_fitting(self.graphs, ch.num_tokens)
        return None if size is None else self.graphs[size]

    def launch(self, g: BucketGraphs, chunks, n: int, row_starts: list[int]) -> LaunchedStep:
        """Replay `g` for the one chunk of `n` tokens already in the host buffers (`_fill`)."""
        r = self.runner
        spans = [(0, 1)]  # one logit row: the chunk's last
        if r.grammar is not None:
            r._fill_masks(chunks, [0], spans)  # clears a mask row an earlier constrained step left
        r._pad(n, 1, g, chunks)
        self.d_last.fill_(n - 1)
        r._upload(g.rows, 1)
        g.graph.replay()
        self.replays += 1
        hidden = r.hidden_out[r.next_out][:n]
        hidden.copy_(g.hidden[:n])
        step = LaunchedStep(chunks, hidden, row_starts, [0], spans)
        r._picks_from(step, g, g.logits, g.best, g.best_lp, g.lse)
        return step
