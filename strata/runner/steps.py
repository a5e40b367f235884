"""What one runner step hands on: the launched step, its sampled tokens, and the CUDA graphs of a
batch-size bucket (`ModelRunner.capture_graphs` makes them, `launch` / `launch_head` replay them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.runner.graph_pieces import GraphCutter, GraphPieces


@dataclass
class Sampled:
    tokens: list[int]  # one token, or with drafts: the accepted drafts then the target's own token
    logprobs: list[float]
    # Per token, when the request asked for alternatives: its row's most likely (token id, logprob),
    # descending, under the distribution `logprobs` are taken from.
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class LaunchedStep:
    """A step whose forward is queued on the device; `ModelRunner.collect` turns it into tokens.

    Each sampling row's pick (its argmax, or its draw from the device sampler) and logprob are already
    on their way into pinned host memory (`ready` fires when they land), so collecting a step costs one
    event wait and no device round trip; only sampled drafts are verified on the host."""

    chunks: list
    hidden: torch.Tensor
    row_starts: list[int]
    picks: list[int]  # chunk indices that sample
    spans: list[tuple[int, int]]  # per pick: first logit row, rows (drafts + 1)
    logits: torch.Tensor | None = None  # fp32 logits of the picked rows
    lse: torch.Tensor | None = None  # their log-sum-exp: logprob(t) = logits[t] - lse
    out: int = 0  # which pinned output buffer
    ready: torch.cuda.Event | None = None
    top_k: int = 0  # alternatives per picked row in the pinned top buffers (0: none asked for)
    head_pending: bool = False  # forward only so far: `ModelRunner.launch_head` samples (grammar run-ahead)
    graph: "BucketGraphs | None" = None  # the bucket whose forward graph ran (two-stage steps)
    # Pipeline stages: the step in flight on the later stages (`strata.dist.link.InFlight`), until collected.
    remote: object | None = None
    # Requests whose sampling failed in this step (id -> why): their picks are placeholders, and the
    # engine fails them alone.
    faults: dict[str, str] = field(default_factory=dict)


@dataclass
class BucketGraphs:
    graph: "torch.cuda.CUDAGraph | GraphPieces"  # pieces where layers wait for the host (`graph_pieces`)
    seqs: int
    rows: int
    hidden: torch.Tensor
    logits: torch.Tensor
    best: torch.Tensor
    best_lp: torch.Tensor
    lse: torch.Tensor
    # Two-stage steps (grammar run-ahead): the forward alone, and the head over its hidden states.
    forward: torch.cuda.CUDAGraph | None = None
    forward_hidden: torch.Tensor | None = None
    head: torch.cuda.CUDAGraph | None = None
    head_outputs: tuple[torch.Tensor, ...] = ()  # logits, best, best_lp, lse


def capture_bucket(body, rows: int, seqs: int, pool, stream: torch.cuda.Stream, device,
                   cutter: GraphCutter | None = None) -> BucketGraphs:
    """`body(rows)` → (hidden, logits, best, best_lp, lse), run twice on `stream` (kernels compile and
    library handles are made outside the capture), then captured on `pool` (through `cutter`, in
    pieces, where layers wait for the host); the inputs are already in the runner's static buffers."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            body(rows)
    torch.cuda.current_stream(device).wait_stream(stream)
    if cutter is not None:
        graph, outputs = cutter.capture(body, rows)
        return BucketGraphs(graph, seqs, rows, *outputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = body(rows)
    return BucketGraphs(graph, seqs, rows, *outputs)

