"""The SM count that kernel configurations are planned for.

Split-K factors, tile widths and attention key splits are chosen so that a launch fills the GPU:
`DEFAULT_SMS` (132, the H200's and the H100's), a constant so that configurations depend on shapes
only. `planning_for(n)` chooses them for n SMs instead, in the calling context only (a ContextVar):
a decode whose CUDA graphs are captured inside it is planned for the SMs that a concurrent read in a
green context leaves it (issue 11). `strata bench sm-split --plan-sms` measures what that gives;
serving does not use it yet."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

DEFAULT_SMS = 132
_PLANNED: ContextVar[int] = ContextVar("strata_planned_sms", default=DEFAULT_SMS)


def planned_sms() -> int:
    return _PLANNED.get()


@contextmanager
def planning_for(sms: int) -> Iterator[None]:
    if sms < 1:
        raise ValueError(f"plan for at least one SM, not {sms}")
    token = _PLANNED.set(sms)
    try:
        yield
    finally:
        _PLANNED.reset(token)
