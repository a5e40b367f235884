"""Graph pieces (strata/runner/graph_pieces.py) without a GPU: the replay order of pieces and host parts,
and the rows each host part is given. Capture itself runs on CUDA (tests/gpu/test_gpu_host_experts.py)."""

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
