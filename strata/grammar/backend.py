"""The seam between Strata and a grammar engine: what `GrammarCompiler` and `GrammarMatcher` need from
one. llguidance implements it (`llguidance_backend.py`); another engine (xgrammar) would be a second
implementation of these two classes, chosen by name in `GrammarCompiler`.

Masks are rows of int32 words, bit `t % 32` of word `t // 32` set when token `t` is allowed (the
layout both engines write), in caller-owned host memory: a C-contiguous numpy view, e.g. of a pinned
torch tensor, so that filling allocates nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import numpy as np

from strata.grammar.spec import GrammarSpec


class EngineMatcher(ABC):
    """One request's parse state in the engine."""

    @abstractmethod
    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row` (int32, C-contiguous, the compiler's mask_words)."""

    @abstractmethod
    def try_accept(self, tokens: Sequence[int]) -> int:
        """Advances over the longest valid prefix of `tokens`; returns its length. An invalid token
        leaves the state as it was before that token (never an error state). Stop tokens never reach
        an engine matcher: `GrammarMatcher` handles them (engines disagree on whether one is a token
        to roll back)."""

    @abstractmethod
    def count_valid(self, tokens: Sequence[int]) -> int:
        """The length of the longest prefix of `tokens` the grammar accepts from here; no state change."""

    @abstractmethod
    def rollback(self, n: int) -> None: ...

    @abstractmethod
    def is_accepting(self) -> bool:
        """The output so far is complete: a stop token is allowed now."""

    @abstractmethod
    def is_stopped(self) -> bool:
        """Nothing but a stop token is allowed now: the grammar cannot go on."""

    @abstractmethod
    def copy(self) -> "EngineMatcher": ...


class GrammarBackend(ABC):
    """One engine over one tokenizer: built once per served model."""

    name: ClassVar[str]

    def __init__(self, tk_json: str, vocab_size: int, stop_ids: Sequence[int], threads: int):
        """`tk_json`: the HF `tokenizers` tokenizer as JSON (`Tokenizer.to_str()`); `vocab_size`: the
        mask width in tokens (at least the tokenizer's); `stop_ids`: the tokens that end the output."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """An engine object from which `new_matcher` makes matchers; raises GrammarError."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> EngineMatcher: ...

    @abstractmethod
    def fill_rows(self, entries: Sequence[tuple[EngineMatcher, int, Sequence[int]]], bitmask: np.ndarray) -> None:
        """For each (matcher, row, drafts): `bitmask[row]` = the mask now and `bitmask[row + 1 + i]` =
        the mask after `drafts[:i + 1]`; every draft is valid and none is a stop token. Matcher states
        are unchanged after."""

    @staticmethod
    @abstractmethod
    def check(spec: GrammarSpec) -> str:
        """Checks a spec without a tokenizer: "" when it compiles, else the problem."""
