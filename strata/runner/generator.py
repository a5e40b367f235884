"""Single-sequence generation on a contiguous K/V cache: the engine behind `strata generate` and
`strata.LLM` until the serving engine (paged cache, slots, scheduler) takes over.

Text is produced incrementally: a token's text is emitted once the bytes decoded so far form
complete characters, and text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from strata.attention import ContiguousKV
from strata.models.transformer import CausalLM
from strata.sampling import Sampler, SamplingParams
from strata.tokenizer import Tokenizer


@dataclass
class Chunk:
    """One streamed piece: the new token ids and the text they complete (may be empty)."""

    token_ids: list[int]
    text: str


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0


class Detokenizer:
    """Turns a growing list of ids into text deltas without splitting UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int] = ()):
        self.tok = tokenizer
        # A few prompt tokens give the decoder the context it needs for leading spaces (SentencePiece).
        self.ids: list[int] = list(prompt_tail)
        self.offset = len(self.ids)
        self.prefix_text = self.tok.decode(self.ids) if self.ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        delta = text[len(self.prefix_text) :]
        self.prefix_text = text
        return delta


class StopChecker:
    """Finds stop strings in the generated text; holds back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, stopped)."""
        self.text += delta
        if self.stops:
            search_from = max(0, self.emitted - self.hold)
            hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                out = self.text[self.emitted :]
                self.emitted = len(self.text)
                return out, True
        safe = len(self.text) - self.hold if self.stops else len(self.text)
        out = self.text[self.emitted : max(safe, self.emitted)]
        self.emitted += len(out)
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class Generator:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, ctx: int, device: torch.device, dtype: torch.dtype):
        self.model, self.tok, self.ctx = model, tokenizer, ctx
        self.device, self.dtype = torch.device(device), dtype
        cfg = model.config
        self.cache = ContiguousKV(model.num_attention_layers, ctx, cfg.num_key_value_heads, cfg.head_dim, self.device, dtype)
        if cfg.is_hybrid:
            self.cache.states = model.new_states(1, self.device, dtype)

    @torch.inference_mode()
    def _forward_last(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        n = ids.shape[0]
        self.cache.step(start, n)
        if self.cache.states is not None:
            self.cache.states.set_spans([(0, n, 0, start == 0, False)])
        positions = torch.arange(start, start + n, device=self.device)
        hidden = self.model(ids, positions, self.cache)
        return self.model.compute_logits(hidden[-1:])[0]

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, completion: Completion | None = None) -> Iterator[Chunk]:
        """Yields chunks as tokens are generated; fills `completion` (if given) as it goes."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        budget = self.ctx - len(prompt_ids)
        if budget <= 0:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.ctx}")
        out = completion or Completion(prompt_token_ids=list(prompt_ids))
        max_new = min(params.max_tokens, budget)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tok.stop_ids))
        sampler = Sampler(params)
        detok = Detokenizer(self.tok, prompt_ids[-4:])
        stops = StopChecker(params.stop)
        seen = torch.tensor(list(prompt_ids), dtype=torch.long)

        t0 = time.perf_counter()
        ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)
        logits = self._forward_last(ids, 0)
        pos = len(prompt_ids)
        out.prompt_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        out.finish_reason = "length"
        while len(out.token_ids) < max_new:
            tok = sampler(logits, seen if params.repetition_penalty != 1.0 else None, out.token_ids)
            if tok in stop_ids:
                out.finish_reason = "stop"
                break
            out.token_ids.append(tok)
            if params.repetition_penalty != 1.0:
                seen = torch.cat([seen, torch.tensor([tok])])
            text, stopped = stops.push(detok.push(tok))
            out.text += text
            yield Chunk([tok], text)
            if stopped:
                out.finish_reason = "stop"
                break
            if len(out.token_ids) == max_new:
                break
            logits = self._forward_last(torch.tensor([tok], device=self.device), pos)
            pos += 1
        tail = stops.flush()  # empty after a stop-string hit, which already cut the text
        if tail:
            out.text += tail
            yield Chunk([], tail)
        out.decode_seconds = time.perf_counter() - t1

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        out = Completion(prompt_token_ids=list(prompt_ids))
        for _ in self.stream(prompt_ids, params, out):
            pass
        return out
