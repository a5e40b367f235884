"""Structured output: grammars (JSON schemas, regexes, GBNF/Lark, tool calls) that constrain sampling.

`GrammarSpec` (spec.py) is plain data carried on `SamplingParams.grammar`; `GrammarCompiler` and
`GrammarMatcher` (compiler.py) run it on a grammar engine (llguidance, behind `backend.py`'s seam).
docs/STRUCTURED_OUTPUT.md says how the engine was chosen and how the serving engine drives these.
"""

from strata.grammar.compiler import (CompiledGrammar, GrammarCompiler, GrammarMatcher, check_spec, mask_words,
                                     valid_prefix)
from strata.grammar.spec import GrammarError, GrammarKind, GrammarSpec

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarKind", "GrammarMatcher", "GrammarSpec",
           "check_spec", "mask_words", "valid_prefix"]
