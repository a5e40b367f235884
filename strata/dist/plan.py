"""Which decoder layers and which device each pipeline stage gets (pure arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass


def layer_ranges(num_layers: int, shares: list[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage, in proportion to `shares` (llama.cpp's --tensor-split):
    cumulative shares rounded to layer boundaries, every stage at least one layer."""
    n = len(shares)
    if n > num_layers:
        raise ValueError(f"{n} stages need at least {n} layers; the model has {num_layers}")
    total = float(sum(shares))
    bounds, acc = [0], 0.0
    for i, s in enumerate(shares[:-1]):
        acc += s
        b = int(round(num_layers * acc / total))
        # at least one layer for this stage and for each stage after it
        bounds.append(min(max(b, bounds[-1] + 1), num_layers - (n - 1 - i)))
    bounds.append(num_layers)
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def parse_shares(text: str | None, stages: int) -> list[float]:
    if text is None:
        return [1.0] * stages
    shares = [float(x) for x in text.split(",")]
    if len(shares) != stages:
        raise ValueError(f"--tensor-split names {len(shares)} stages; there are {stages}")
    return shares


def parse_devices(text: str | None) -> list[str] | None:
    """--devices "0,1" or "cuda:0,cuda:1" (llama.cpp's CUDA0 too) -> ["cuda:0", "cuda:1"]."""
    if text is None:
        return None
    out = []
    for d in (x.strip() for x in text.split(",")):
        idx = d.lower().removeprefix("cuda:").removeprefix("cuda")
        if not idx.isdigit():
            raise ValueError(f"--devices: {d!r} is not a GPU index (0, cuda:0, CUDA0)")
        out.append(f"cuda:{int(idx)}")
    return out


@dataclass(frozen=True)
class StagePlan:
    """The pipeline as every rank sees it: `ranges[r]` is rank r's layers; `device` this rank's."""

    rank: int
    world: int
    ranges: tuple[tuple[int, int], ...]
    device: str
    sharing: int = 1  # the stages of this machine on `device` (more than one only to test on one card)

    @property
    def layers(self) -> tuple[int, int]:
        return self.ranges[self.rank]

    def describe(self) -> str:
        return ", ".join(f"stage {r}: layers {a}-{b - 1}" for r, (a, b) in enumerate(self.ranges))


def stage_count(tensor_split: str | None, devices: list[str] | None, nnodes: int, cuda_count: int, cuda: bool) -> int:
    """Stages in all: the shares named, else --devices x machines, else every GPU of each machine."""
    if tensor_split is not None:
        return len(tensor_split.split(","))
    if devices is not None:
        return len(devices) * nnodes
    if cuda and cuda_count:
        return cuda_count * nnodes
    raise ValueError("--split-mode layer on the CPU: name the stages with --tensor-split (e.g. 1,1)")


def stage_device(local: int, devices: list[str] | None, cuda: bool) -> str:
    if not cuda:
        return "cpu"
    if devices is not None:
        if local >= len(devices):
            raise ValueError(f"stage {local} of this machine has no device in --devices")
        return devices[local]
    return f"cuda:{local}"
