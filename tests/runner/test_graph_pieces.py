"""Graph pieces (strata/runner/graph_pieces.py) without a GPU: the replay order of pieces and host parts,
the rows each host part is given, and what a MoE layer's cut hands over. Capture itself runs on CUDA
(tests/gpu/test_gpu_host_experts.py)."""

from strata.runner.graph_pieces import GraphPieces, replay


class Piece:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)


def test_pieces_alternate_with_host_parts_after_a_wait(monkeypatch):
    log: list = []
    monkeypatch.setattr("torch.cuda.current_stream", lambda: type("S", (), {"synchronize": lambda s: log.append("wait")})())
    g = GraphPieces()
    g.pieces = [Piece(f"piece{i}", log) for i in range(3)]
    g.host_parts = [lambda rows, i=i: log.append(f"host{i}:{rows}") for i in range(2)]
    replay(g, 3)
    assert log == ["piece0", "wait", "host0:3", "piece1", "wait", "host1:3", "piece2"]
    log.clear()
    plain = Piece("graph", log)
    replay(plain, 5)
    assert log == ["graph"]


def test_a_layer_cut_computes_the_real_rows_into_the_pinned_sum():
    """`MoE._cut_graph` on CPU stand-ins for the staging buffers: the cut hands over a host part that
    computes the step's first `rows` rows (all the captured rows when None) into `out_cast`, the rows
    the next piece copies up; the padding rows are left as they were."""
    from types import SimpleNamespace

    import torch

    from strata.models.host_experts import HostExperts
    from strata.models.moe import MoE

    g = torch.Generator().manual_seed(0)
    host = HostExperts.from_stacks(torch.randn(6, 16, 32, generator=g), torch.randn(6, 32, 8, generator=g))
    t = 4
    staging = SimpleNamespace(out=torch.zeros(8, 32), out_cast=torch.full((8, 32), 7.0), dev=torch.zeros(8, 32))
    x, ids, w = torch.randn(t, 32, generator=g), torch.tensor([[0, 1], [2, 3], [4, 5], [1, 2]]), torch.rand(t, 2)
    parts: list = []
    layer = SimpleNamespace(host=host, graph_cut=SimpleNamespace(cut=lambda part, beside=None: parts.append(part)))
    out = MoE._cut_graph(layer, staging, x, ids, w)
    assert len(parts) == 1 and out.data_ptr() == staging.dev.data_ptr() and out.shape == (t, 32)
    parts[0](3)
    torch.testing.assert_close(staging.out_cast[:3], host.forward(x[:3], ids[:3], w[:3]))
    assert bool((staging.out_cast[3:] == 7.0).all())
    parts[0](None)
    torch.testing.assert_close(staging.out_cast[:t], host.forward(x, ids, w))


def test_work_beside_a_cut_is_a_graph_of_its_own_launched_before_the_host_part(monkeypatch):
    """`GraphCutter.cut(host_part, beside)`: the GPU work `beside` queues is captured between the piece
    before the cut and the one after, as its own graph, which each replay launches after the wait for
    the piece before and just before the host part (so the device computes it while the host computes),
    and the piece after follows both."""
    import contextlib

    import torch

    from strata.runner import graph_pieces

    log: list = []
    capturing: list = []

    class FakeGraph:
        count = 0

        def __init__(self) -> None:
            self.name, self.work = f"graph{FakeGraph.count}", []
            FakeGraph.count += 1

        def capture_begin(self, pool=None) -> None:
            capturing.append(self)

        def capture_end(self) -> None:
            capturing.remove(self)

        def replay(self) -> None:
            log.extend(self.work)

    def launch(name: str) -> None:  # a kernel queued under capture lands in the graph being captured
        capturing[-1].work.append(name)

    monkeypatch.setattr(graph_pieces.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(graph_pieces.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(graph_pieces.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"synchronize": lambda s: log.append("wait")})())
    cutter = graph_pieces.GraphCutter(pool=None, stream=None)

    def body() -> str:
        launch("attention")
        cutter.cut(lambda rows: log.append(f"host:{rows}"), beside=lambda: launch("pcie read"))
        launch("sum up")
        return "out"

    pieces, out = cutter.capture(body)
    assert out == "out" and isinstance(pieces, graph_pieces.GraphPieces) and len(pieces.pieces) == 2
    assert not capturing
    pieces.replay(2)
    assert log == ["attention", "wait", "pcie read", "host:2", "sum up"]
