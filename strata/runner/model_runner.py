"""Runs one scheduled step: builds the batch inputs, runs the model over the paged KV pool, samples.

Batch inputs go into buffers allocated once for the largest step (`max_num_batched_tokens` tokens,
`max_seqs` sequences): a step fills a prefix of each on the host and copies it to the device in one
transfer per buffer, so nothing on the hot path allocates device memory for inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kvcache.pool import KVPool
from strata.models.transformer import CausalLM
from strata.runner.paged_attention import PagedAttention
from strata.runner.sampling import Sampler, filtered_probs
from strata.spec.verify import verify_greedy, verify_sampled


@dataclass
class Sampled:
    tokens: list[int]  # one token, or with drafts: the accepted drafts then the target's own token
    logprobs: list[float]


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, *, max_num_batched_tokens: int, max_seqs: int,
                 max_model_len: int, device: torch.device, seed: int | None = None):
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.attn = PagedAttention(pool)
        bs = pool.block_size
        self.max_blocks = (max_model_len + bs - 1) // bs
        pin = self.device.type == "cuda"
        t, s = max_num_batched_tokens, max_seqs
        # Host staging (pinned on CUDA) and device buffers, one of each, reused every step.
        self.h_ids = torch.zeros(t, dtype=torch.long, pin_memory=pin)
        self.h_pos = torch.zeros(t, dtype=torch.long, pin_memory=pin)
        self.h_slots = torch.zeros(t, dtype=torch.long, pin_memory=pin)
        self.h_tables = torch.zeros(s, self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.d_ids = torch.zeros(t, dtype=torch.long, device=self.device)
        self.d_pos = torch.zeros(t, dtype=torch.long, device=self.device)
        self.d_slots = torch.zeros(t, dtype=torch.long, device=self.device)
        self.d_tables = torch.zeros(s, self.max_blocks, dtype=torch.int32, device=self.device)
        # The host buffers are reused every step: before refilling them, wait until the previous step's
        # copies out of them have finished (a step that samples nothing never syncs otherwise).
        self.copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.samplers: dict[str, Sampler] = {}
        self.seed, self.sampled_requests = seed, 0
        self.hidden: torch.Tensor | None = None
        self.row_starts: list[int] = []

    def release(self, request_id: str) -> None:
        self.samplers.pop(request_id, None)

    def sampler(self, req) -> Sampler:
        """The request's sampler. With an engine seed, requests that bring none get seeds derived from
        it in arrival order, so a whole run is reproducible."""
        s = self.samplers.get(req.request_id)
        if s is None:
            default = None if self.seed is None else self.seed * 1_000_003 + self.sampled_requests
            self.sampled_requests += 1
            s = self.samplers[req.request_id] = Sampler(req.params, default)
        return s

    def _fill(self, chunks) -> tuple[int, list[int], list[int]]:
        if self.copied is not None:
            self.copied.synchronize()
        bs = self.pool.block_size
        n = 0
        starts, lens = [], []
        for r, ch in enumerate(chunks):
            req, s, k = ch.request, ch.start, ch.num_tokens
            ids = ch.token_ids
            pos = torch.arange(s, s + k)
            table = torch.tensor(req.block_ids, dtype=torch.long)
            self.h_ids[n : n + k] = torch.tensor(ids, dtype=torch.long)
            self.h_pos[n : n + k] = pos
            self.h_slots[n : n + k] = table[pos // bs] * bs + pos % bs
            self.h_tables[r].zero_()
            self.h_tables[r, : len(req.block_ids)] = table.to(torch.int32)
            starts.append(s)
            lens.append(k)
            n += k
        return n, starts, lens

    @torch.inference_mode()
    def execute(self, chunks, draft_probs: dict[str, torch.Tensor] | None = None) -> dict[str, Sampled]:
        """chunks: the scheduler's `ScheduledChunk`s. Returns the tokens of each chunk that reaches
        the end of its request's tokens (`chunk.sample`): one sampled token, or with drafts the
        verified ones. `draft_probs`: the draft distributions of sampled (non-greedy) requests."""
        if not chunks:
            return {}
        n, starts, lens = self._fill(chunks)
        r = len(chunks)
        for h, d, m in ((self.h_ids, self.d_ids, n), (self.h_pos, self.d_pos, n), (self.h_slots, self.d_slots, n)):
            d[:m].copy_(h[:m], non_blocking=True)
        self.d_tables[:r].copy_(self.h_tables[:r], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.attn.prepare(self.d_slots[:n], starts, lens, self.d_tables[:r])
        hidden = self.model(self.d_ids[:n], self.d_pos[:n], self.attn)

        self.hidden = hidden  # the drafter reads the step's hidden states
        self.row_starts = (torch.tensor(lens).cumsum(0) - torch.tensor(lens)).tolist()
        picks = [i for i, ch in enumerate(chunks) if ch.sample]
        if not picks:
            return {}
        # Logit rows: the last row of each sampling chunk, or its last k+1 rows with k drafts.
        rows, spans = [], []
        for i in picks:
            ch = chunks[i]
            first = self.row_starts[i] + ch.num_tokens - len(ch.drafts) - 1
            spans.append((len(rows), len(ch.drafts) + 1))
            rows.extend(range(first, first + len(ch.drafts) + 1))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = logits.argmax(-1).tolist()
        out: dict[str, Sampled] = {}
        for i, (r0, k1) in zip(picks, spans):
            ch = chunks[i]
            req, p = ch.request, ch.request.params
            if p.greedy and p.repetition_penalty == 1.0:
                toks = verify_greedy(list(ch.drafts), greedy[r0 : r0 + k1]) if ch.drafts else [greedy[r0]]
            else:
                sampler = self.sampler(req)
                if ch.drafts:
                    q = (draft_probs or {}).get(req.request_id)
                    target = torch.stack([filtered_probs(logits[r0 + j], p) for j in range(k1)]).cpu()
                    toks = verify_sampled(list(ch.drafts), q, target, sampler.gen)
                else:
                    seen = torch.tensor(req.all_ids) if p.repetition_penalty != 1.0 else None
                    toks = [sampler(logits[r0], seen)]
            out[req.request_id] = Sampled(toks, [float(logprobs[r0 + j, t]) for j, t in enumerate(toks)])
        return out
