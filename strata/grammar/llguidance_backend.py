"""The llguidance engine (guidance-ai/llguidance): an Earley parser over a lazily built lexer DFA.

Compiling is cheap (a few ms even for nested schemas: the lexer states are built on first use and
shared by every matcher copied from the same compiled grammar), so a compiled grammar is one fresh
`LLMatcher` that each request copies. Masks are computed with the GIL released; a batch's rows, drafts
included, are filled in parallel on an `LLExecutor`'s threads.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from strata.grammar.backend import EngineMatcher, GrammarBackend
from strata.grammar.spec import GrammarError, GrammarSpec, bounded_integers, close_objects

# JSON is generated compact: no whitespace between tokens, "," and ":" as separators. Free whitespace
# lets a small model wander (a run of spaces or blank lines until max_tokens); vLLM and SGLang default
# to compact JSON for the same reason.
JSON_COMPACT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_ERROR_CHARS = 800


def json_options(strict: bool) -> dict[str, Any]:
    """llguidance's JSON compile options for a spec's `strict`: compact, and strict fails on
    unimplemented keywords where lenient ignores them."""
    return {**JSON_COMPACT, "lenient": not strict}


def _grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON wrapping of Lark / JSON-schema / regex sources) of a spec."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if spec.kind in ("json_object", "json_schema"):
            schema = bounded_integers(spec.schema())
            if spec.strict:
                schema = close_objects(schema)
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=json_options(spec.strict))
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "grammar":
            return LLMatcher.grammar_from_lark(any_to_lark(spec.text))
        return LLMatcher.grammar_from_lark(spec.text)
    except Exception as e:  # the GBNF converter raises its own error types; schema text errors are ValueErrors
        raise GrammarError(_problem(spec, str(e))) from None


def _problem(spec: GrammarSpec, message: str) -> str:
    what = {"json_object": "JSON object grammar", "json_schema": "JSON schema", "regex": "regex",
            "grammar": "grammar", "tool_call": "tool-call grammar"}[spec.kind]
    message = message.strip()
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + " ..."
    return f"invalid {what}: {message}"


class LlguidanceMatcher(EngineMatcher):
    def __init__(self, m: Any):
        self.m = m

    def fill(self, row: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def try_accept(self, tokens: Sequence[int]) -> int:
        return self.m.try_consume_tokens(list(tokens))

    def count_valid(self, tokens: Sequence[int]) -> int:
        return self.m.validate_tokens(list(tokens))

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self.m.get_error()}")

    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    def is_stopped(self) -> bool:
        return self.m.is_stopped()

    def copy(self) -> "LlguidanceMatcher":
        return LlguidanceMatcher(self.m.deep_copy())


def _handle(m: EngineMatcher) -> Any:
    if not isinstance(m, LlguidanceMatcher):
        raise TypeError(f"an llguidance backend cannot fill a {type(m).__name__}")
    return m.m


class LlguidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tk_json: str, vocab_size: int, stop_ids: Sequence[int], threads: int):
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tk_json, n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, spec: GrammarSpec) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, _grammar_text(spec), log_level=0)
        if m.is_error():
            raise GrammarError(_problem(spec, m.get_error()))
        return m

    def new_matcher(self, compiled: Any) -> LlguidanceMatcher:
        return LlguidanceMatcher(compiled.deep_copy())

    def fill_rows(self, entries: Sequence[tuple[EngineMatcher, int, Sequence[int]]], bitmask: np.ndarray) -> None:
        plain = [(_handle(m), row) for m, row, drafts in entries if not drafts]
        drafted = [(_handle(m), row, list(drafts)) for m, row, drafts in entries if drafts]
        ptr, row_bytes, rows = bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, rows)
        if drafted:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, row_bytes, rows)

    @staticmethod
    def check(spec: GrammarSpec) -> str:
        from llguidance import LLMatcher

        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(_grammar_text(spec))
        except GrammarError as e:
            return str(e)
        return _problem(spec, "; ".join(messages)) if is_error else ""
