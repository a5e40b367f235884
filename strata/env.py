"""The one typed registry of STRATA_* environment switches. Nothing else in Strata reads os.environ.

Each switch is declared once with its type, default and meaning; `strata.env.ENV.<name>` reads it at
call time so tests can set the variable per case.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


def _bool(s: str) -> bool:
    return s.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Switch(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None


class _Env:
    SPLIT_MTP_BATCH = Switch("STRATA_SPLIT_MTP_BATCH", _bool, False,
                             "compute the MTP layer's prompt K/V batched, chunk by chunk, during the prompt read")
    PIPED_CONCURRENT = Switch("STRATA_PIPED_CONCURRENT", _bool, False,
                              "run prompt reads as their own stage beside decoding: a worker thread, on CUDA its own "
                              "low-priority stream (docs/CONCURRENT_READ.md)")
    PIPED_CONCURRENT_SMB = Switch("STRATA_PIPED_CONCURRENT_SMB", _bool, False,
                                  "let STRATA_SPLIT_MTP_BATCH run beside STRATA_PIPED_CONCURRENT: the read stage writes "
                                  "the draft K/V itself, its stream-K pool grown before each read")
    NO_PROGRESS = Switch("STRATA_NO_PROGRESS", _bool, False, "hide the weight-loading progress bar")
    STAGE_TRACE = Switch("STRATA_STAGE_TRACE", str, "",
                         "a directory where each pipeline stage (--split-mode layer) writes a line per step it "
                         "sends and receives, stage{rank}.trace (tests read the pipeline's order from them)")
    CACHE_DIR = Switch("STRATA_CACHE_DIR", str, "",
                       "where test fixtures, downloads and the compiled CPU kernels are cached (empty: "
                       "~/.cache/strata for the kernels)")
    API_KEY = Switch("STRATA_API_KEY", str, "", "the server's API key when --api-key is not given")
    LOG_LEVEL = Switch("STRATA_LOG_LEVEL", str, "",
                       "level of strata's own log on stderr (DEBUG, INFO, WARNING, ...); empty: INFO for "
                       "`strata serve`, WARNING for the other commands")

    def __getattr__(self, item: str):  # pragma: no cover - typo guard
        raise AttributeError(f"unknown Strata switch {item!r}")

    def switches(self) -> list[Switch]:
        return [v for v in type(self).__dict__.values() if isinstance(v, Switch)]

    def value(self, switch: Switch[T]) -> T:
        return switch.get()

    def set_in_environment(self) -> dict[str, str]:
        """The switches set in this process's environment, as written there (a bench result records
        them: part of the command it came from)."""
        return {s.name: os.environ[s.name] for s in self.switches() if s.name in os.environ}


ENV = _Env()


def child_environment(pythonpath_first: str) -> dict[str, str]:
    """This process's environment for a child Python process, with `pythonpath_first` ahead on its
    PYTHONPATH (benchmarks start their clients this way)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath_first + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def torch_allocator_configured() -> bool:
    """Whether the user set torch's CUDA allocator options (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF),
    which Strata then leaves as they are."""
    return any(os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))


def get(switch: Switch[T]) -> T:
    return switch.get()


@contextmanager
def overridden(switch: Switch, value: str | None) -> Iterator[None]:
    """Sets (or, with None, unsets) a switch for the duration of a block; benchmarks compare arms."""
    old = os.environ.get(switch.name)
    if value is None:
        os.environ.pop(switch.name, None)
    else:
        os.environ[switch.name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(switch.name, None)
        else:
            os.environ[switch.name] = old
