"""The SM count that kernel configurations are planned for.

Split-K factors and tile widths are chosen so that a launch fills the GPU: `DEFAULT_SMS` (132, the
H200's and the H100's), a constant so that configurations depend on shapes only. `planning_for(n)`
with n below it, in the calling context only (a ContextVar), gives the 16-bit GEMVs the tiles of
`gemv.few_sms_config` instead: the decode graphs that the engine replays while a concurrent read holds
most SMs in its green context (`STRATA_READ_SMS`, issue 11) are captured inside it. Only what keeps
every sum and its order may change there (tile widths, pipeline depth), so a token decoded beside a
read has the bits it would have alone; split counts, the dp4a GEMVs and attention's key splits stay.
"""

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
