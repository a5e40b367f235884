"""CUDA graphs of steps that wait for the host between layers (MoE layers whose routed experts are in RAM).

No graph can hold a step whose layers hand their rows to the CPU and wait for the sum, so such a step
is captured in pieces: the forward runs once under capture, and each layer with experts in RAM, after
queuing its rows' copy down to pinned memory (and its shared expert), calls `GraphCutter.cut` with its
host part. The cut ends the piece being captured and starts the next, which begins with the copy of the
host's sum back up. Replaying the pieces (`GraphPieces.replay`) launches each piece with one call, waits
for it, runs the host part over the step's real rows, and launches the next: a layer's GPU work costs
one launch instead of one per kernel, which is what a decode step with the experts on the CPU spends
most of its GPU-side time on.

All pieces of one capture share the bucket graphs' memory pool and replay in the order they were
captured, as graphs that share a pool must.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

HostPart = Callable[[int | None], None]  # computes the step's first `rows` rows on the host


class GraphPieces:
    """One step's graph in pieces, with a host part between each two."""

    def __init__(self) -> None:
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.host_parts: list[HostPart] = []

    def replay(self, rows: int | None = None) -> None:
        """Every piece in order; before each after the first, the device's work so far is waited for and
        the host part runs over the first `rows` rows (None: the rows captured)."""
        self.pieces[0].replay()
        stream = torch.cuda.current_stream()
        for part, piece in zip(self.host_parts, self.pieces[1:]):
            stream.synchronize()
            part(rows)
            piece.replay()


class GraphCutter:
    """Captures a body that modules may cut (`cut`), on one pool and side stream. Handed to the modules
    that cut (their `graph_cut`) for the time of the captures."""

    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self.pool, self.stream = pool, stream
        self._pieces: GraphPieces | None = None
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def capturing(self) -> bool:
        return self._graph is not None

    def capture(self, body: Callable[..., Any], *args: Any) -> tuple[torch.cuda.CUDAGraph | GraphPieces, Any]:
        """(the graph, body's outputs): a plain CUDA graph when nothing cut it, else its pieces."""
        pieces = self._pieces = GraphPieces()
        torch.cuda.synchronize()  # as torch.cuda.graph does: nothing of earlier work is captured or pending
        with torch.cuda.stream(self.stream):
            self._begin()
            try:
                outputs = body(*args)
            finally:
                graph, self._graph, self._pieces = self._graph, None, None
                graph.capture_end()
                pieces.pieces.append(graph)
        return (pieces if pieces.host_parts else pieces.pieces[0]), outputs

    def cut(self, host_part: HostPart, beside: Callable[[], Any] | None = None) -> None:
        """End the piece being captured here; `host_part` runs between it and the next, which starts now.
        `beside`: GPU work captured as a graph of its own that each replay launches just before the host
        part, so the device computes it while the host computes its part (the piece before the cut is
        waited for; this one is not)."""
        if self._graph is None or self._pieces is None:
            raise RuntimeError("a graph cut outside a capture")
        self._graph.capture_end()
        self._pieces.pieces.append(self._graph)
        if beside is not None:
            self._begin()
            beside()
            side, self._graph = self._graph, None
            side.capture_end()
            part = host_part

            def host_part(rows: int | None) -> None:
                side.replay()
                part(rows)

        self._pieces.host_parts.append(host_part)
        self._begin()

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)


def replay(graph: torch.cuda.CUDAGraph | GraphPieces, rows: int) -> None:
    """A bucket's graph for a step of `rows` real rows (pieces compute only those on the host)."""
    if isinstance(graph, GraphPieces):
        graph.replay(rows)
    else:
        graph.replay()
