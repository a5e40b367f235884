"""Grammars compiled for one model's vocabulary, and the per-request matchers the engine steps.

`GrammarCompiler` is built once per served model (its tokenizer info takes ~1-2 s for a 150K vocab);
`compile(spec)` is cached by spec (LRU) and raises `GrammarError` naming the problem. Each request gets
its own `GrammarMatcher` (`compiled.matcher()`): the engine fills its row of the step's host bitmask,
applies the bitmask to the logits on the device (`strata.kernels.token_mask`), and feeds the sampled
token back with `accept`. Drafts under speculation are checked with `valid_prefix` and masked row by
row with `GrammarCompiler.fill_masks`.

Stop tokens: the tokenizer's `stop_ids` end a grammar's output. They are allowed exactly when the
output so far is complete (`can_stop`); when nothing else is allowed (`must_stop`, e.g. after the
closing brace of a JSON object) the engine may finish the request at once instead of sampling the
stop token. After a stop token is accepted the matcher `is_terminated` and its mask allows only stop
tokens, so a row is never left with no allowed token.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from strata.grammar.backend import EngineMatcher, GrammarBackend
from strata.grammar.spec import GrammarError, GrammarSpec

DEFAULT_BACKEND = "llguidance"
DEFAULT_CACHE_SIZE = 256


def _backend_class(name: str) -> type[GrammarBackend]:
    if name == "llguidance":
        from strata.grammar.llguidance_backend import LlguidanceBackend

        return LlguidanceBackend
    raise ValueError(f"unknown grammar backend {name!r} (available: llguidance)")


def mask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=1024)
def _check_message(backend: str, spec: GrammarSpec) -> str:
    return _backend_class(backend).check(spec)


def check_spec(spec: GrammarSpec, backend: str = DEFAULT_BACKEND) -> None:
    """Raises GrammarError if `spec` cannot compile, without a tokenizer (what the HTTP layer can tell
    before a request reaches the engine; a Lark grammar naming a special token the model lacks still
    fails later, in `GrammarCompiler.compile`). Results are cached by spec."""
    problem = _check_message(backend, spec)
    if problem:
        raise GrammarError(problem)


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine thread owns it.

    Stop tokens are handled here, not by the engine: accepting one (when the output is complete) ends
    the output, and rolling it back resumes it."""

    def __init__(self, engine: EngineMatcher, stop_ids: frozenset[int], stop_row: np.ndarray):
        self._m = engine
        self.stop_ids = stop_ids
        self._stop_row = stop_row
        self.words = stop_row.shape[0]
        self._tokens: list[int] = []

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far, a final stop token included (what `rollback` can undo)."""
        return len(self._tokens)

    def fill_mask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row`: int32 [words], C-contiguous (a view into the step's
        host bitmask; nothing is allocated)."""
        if row.dtype != np.int32 or row.shape != (self.words,) or not row.flags.c_contiguous:
            raise ValueError(f"a mask row is int32 [{self.words}] and contiguous, got {row.dtype} {row.shape}")
        if self.is_terminated():
            row[:] = self._stop_row
        else:
            self._m.fill(row)

    def accept(self, token: int) -> bool:
        """Advances over `token` if the grammar allows it; False (state unchanged) if not."""
        if self.is_terminated():
            return False
        if token in self.stop_ids:
            ok = self._m.is_accepting()
        else:
            ok = self._m.try_accept((token,)) == 1
        if ok:
            self._tokens.append(token)
        return ok

    def accept_many(self, tokens: Sequence[int]) -> int:
        """Advances over the longest allowed prefix of `tokens` (nothing follows a stop token); returns
        its length."""
        if self.is_terminated() or not tokens:
            return 0
        body = _until_stop(tokens, self.stop_ids)
        n = self._m.try_accept(body) if body else 0
        self._tokens.extend(body[:n])
        if n == len(body) < len(tokens) and self._m.is_accepting():
            self._tokens.append(tokens[n])
            n += 1
        return n

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, in order, the grammar accepts from here; the state does not change."""
        if self.is_terminated() or not drafts:
            return 0
        body = _until_stop(drafts, self.stop_ids)
        n = self._m.count_valid(body) if body else 0
        if n < len(body) or n == len(drafts):
            return n
        if n == 0:
            return int(self._m.is_accepting())
        self._m.try_accept(body)
        complete = self._m.is_accepting()
        self._m.rollback(n)
        return n + complete

    def rollback(self, n: int) -> None:
        """Undoes the last `n` accepted tokens (rejected drafts, a preempted request's tail)."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot roll back {n} of {len(self._tokens)} accepted tokens")
        if n:
            grammar_tokens = n - self.is_terminated()
            if grammar_tokens:
                self._m.rollback(grammar_tokens)
            del self._tokens[-n:]

    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is finished."""
        return bool(self._tokens) and self._tokens[-1] in self.stop_ids

    def can_stop(self) -> bool:
        """The output so far is complete: a stop token is allowed now (or was accepted)."""
        return self.is_terminated() or self._m.is_accepting()

    def must_stop(self) -> bool:
        """Only a stop token is allowed now, and none was accepted yet: the output is complete and
        cannot go on."""
        return not self.is_terminated() and self._m.is_stopped()

    def copy(self) -> "GrammarMatcher":
        out = GrammarMatcher(self._m.copy(), self.stop_ids, self._stop_row)
        out._tokens = list(self._tokens)
        return out


def _until_stop(tokens: Sequence[int], stop_ids: frozenset[int]) -> list[int]:
    """`tokens` up to (not including) the first stop token."""
    out = []
    for t in tokens:
        if t in stop_ids:
            break
        out.append(t)
    return out


def valid_prefix(matcher: GrammarMatcher, drafts: Sequence[int]) -> int:
    """How many of `drafts` the grammar accepts in order from the matcher's state (left unchanged)."""
    return matcher.valid_prefix(drafts)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for the compiler's vocabulary; `matcher()` starts a request on it."""

    spec: GrammarSpec
    _engine: Any = field(repr=False)
    _compiler: "GrammarCompiler" = field(repr=False)

    def matcher(self) -> GrammarMatcher:
        c = self._compiler
        return GrammarMatcher(c.backend.new_matcher(self._engine), c.stop_ids, c._stop_row)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and one logits width.

    `tokenizer`: a `strata.tokenizer.Tokenizer` (its `tk` is the HF `tokenizers` object, its
    `stop_ids` end a grammar's output unless `stop_ids` is given). `vocab_size`: the model's logits
    width, which may exceed the tokenizer's (padded heads); tokens past the tokenizer are never
    allowed. Masks are `mask_words` int32 words per row. `threads`: the pool that fills a batch's
    masks (default: up to 8 cores). `warm` fills one mask at start-up so that the first request does
    not pay the engine's lazy set-up."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, backend: str = DEFAULT_BACKEND,
                 cache_size: int = DEFAULT_CACHE_SIZE, threads: int | None = None,
                 stop_ids: Iterable[int] | None = None, warm: bool = True):
        tk = tokenizer.tk
        n_tok = tk.get_vocab_size(with_added_tokens=True)
        if vocab_size < n_tok:
            # llguidance needs every tokenizer id in the mask; ids past the logits are simply never read.
            vocab_size = n_tok
        self.vocab_size = vocab_size
        self.mask_words = mask_words(vocab_size)
        self.stop_ids = frozenset(tokenizer.stop_ids if stop_ids is None else stop_ids)
        if not self.stop_ids:
            raise ValueError("a grammar needs at least one stop token")
        self.threads = threads or max(1, min(8, os.cpu_count() or 1))
        self.backend = _backend_class(backend)(tk.to_str(), vocab_size, sorted(self.stop_ids), self.threads)
        self._stop_row = np.zeros(self.mask_words, dtype=np.int32)
        for t in self.stop_ids:
            self._stop_row[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        if warm:
            self.compile(GrammarSpec.json_object()).matcher().fill_mask(np.empty(self.mask_words, np.int32))

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec` (cached); raises GrammarError naming the problem."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = CompiledGrammar(spec, self.backend.compile(spec), self)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return self.compile(spec).matcher()

    def new_bitmask(self, rows: int) -> np.ndarray:
        """A host bitmask [rows, mask_words] with every token allowed (the runner may instead view a
        pinned torch tensor of that shape: `t.numpy()`)."""
        return np.full((rows, self.mask_words), -1, dtype=np.int32)

    def fill_masks(self, entries: Sequence[tuple[GrammarMatcher, int, Sequence[int]]],
                   bitmask: np.ndarray) -> list[int]:
        """Fills a step's grammar rows in parallel. For each (matcher, row, drafts): `bitmask[row]` is
        the mask now and `bitmask[row + 1 + i]` the mask after `drafts[:i + 1]` (a verification step's
        rows); rows of drafts past the first one the grammar rejects are set to all ones. Returns each
        entry's valid-draft count (`valid_prefix`). Matchers are unchanged; rows not named are untouched
        (the caller sets rows without a grammar to all ones)."""
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.mask_words \
                or not bitmask.flags.c_contiguous:
            raise ValueError(f"bitmask: expected int32 [R, {self.mask_words}] C-contiguous, got {bitmask.dtype} "
                             f"{bitmask.shape}")
        work, counts = [], []
        for m, row, drafts in entries:
            if row < 0 or row + len(drafts) >= bitmask.shape[0]:
                raise ValueError(f"rows {row}..{row + len(drafts)} are outside the bitmask's {bitmask.shape[0]}")
            n = m.valid_prefix(drafts)
            counts.append(n)
            bitmask[row + 1 + n: row + 1 + len(drafts)] = -1
            if m.is_terminated():
                bitmask[row] = self._stop_row
                continue
            if n and drafts[n - 1] in self.stop_ids:  # after a stop token, only stop tokens
                n -= 1
                bitmask[row + 1 + n] = self._stop_row
            work.append((m._m, row, list(drafts[:n])))
        self.backend.fill_rows(work, bitmask)
        return counts
