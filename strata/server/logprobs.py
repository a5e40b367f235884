"""Sampled-token logprobs, with their alternatives, in OpenAI's two shapes: chat's per-token entries
and completions' parallel lists."""

from __future__ import annotations

from typing import Any

from strata.server import protocol as P

MIN_LOGPROB = -9999.0  # what an alternative the grammar disallows (-inf) is reported as


class LogprobFormatter:
    """Token ids and logprobs to response bodies; each token's text is decoded once per server."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id], skip_special=False)
        return text

    def _top_entry(self, token_id: int, logprob: float) -> P.TopLogprob:
        tok = self.token_text(token_id)
        # A grammar's mask leaves disallowed alternatives at -inf; OpenAI reports such as -9999.
        return P.TopLogprob(token=tok, logprob=max(logprob, MIN_LOGPROB), bytes=list(tok.encode("utf-8")))

    def chat_logprobs(self, ids: tuple[int, ...] | list[int], lps: Any, tops: Any = None) -> P.ChoiceLogprobs | None:
        if lps is None:
            return None
        content = []
        for j, (t, lp) in enumerate(zip(ids, lps)):
            tok = self.token_text(t)
            top = [self._top_entry(a, v) for a, v in tops[j]] if tops is not None else []
            content.append(P.TokenLogprob(token=tok, logprob=float(lp), bytes=list(tok.encode("utf-8")),
                                          top_logprobs=top))
        return P.ChoiceLogprobs(content=content)

    def completion_logprobs(self, ids: tuple[int, ...] | list[int], lps: Any, offset: int,
                            tops: Any = None) -> P.CompletionLogprobs | None:
        """OpenAI's legacy shape. Alternatives map token text to logprob, so tokens whose texts match
        share the most likely one's entry; the sampled token is always in its map, as OpenAI's."""
        if lps is None:
            return None
        tokens, values, offsets, alternatives = [], [], [], []
        for j, (t, lp) in enumerate(zip(ids, lps)):
            tokens.append(self.token_text(t))
            values.append(float(lp))
            offsets.append(offset)
            offset += len(tokens[-1])
            if tops is not None:
                alt: dict[str, float] = {}
                for a, v in tops[j]:
                    alt.setdefault(self.token_text(a), max(v, MIN_LOGPROB))
                alt.setdefault(tokens[-1], values[-1])
                alternatives.append(alt)
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=offsets,
                                    top_logprobs=alternatives if tops is not None else None)
