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
from strata.runner.transfer import to_device
from strata.spec.verify import verify_greedy, verify_sampled


@dataclass
class Sampled:
    tokens: list[int]  # one token, or with drafts: the accepted drafts then the target's own token
    logprobs: list[float]


@dataclass
class LaunchedStep:
    """A step whose forward is queued on the device; `ModelRunner.collect` turns it into tokens.

    Greedy picks and their logprobs are already on their way into pinned host memory (`ready` fires
    when they land), so collecting a greedy step costs one event wait and no device round trip."""

    chunks: list
    hidden: torch.Tensor
    row_starts: list[int]
    picks: list[int]  # chunk indices that sample
    spans: list[tuple[int, int]]  # per pick: first logit row, rows (drafts + 1)
    logits: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    out: int = 0  # which pinned output buffer
    ready: torch.cuda.Event | None = None


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
        # Pinned outputs, two sets: with overlapped steps one is being filled while the other is read.
        self.h_greedy = [torch.zeros(t, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.h_logprob = [torch.zeros(t, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.next_out = 0
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

    def execute(self, chunks, draft_probs: dict[str, torch.Tensor] | None = None) -> dict[str, Sampled]:
        """Launch and collect in one go (see `launch` and `collect`)."""
        step = self.launch(chunks)
        return self.collect(step, draft_probs) if step is not None else {}

    @torch.inference_mode()
    def launch(self, chunks) -> LaunchedStep | None:
        """Queue one step on the device without waiting for it: inputs, forward, the logit rows of
        chunks that sample (`chunk.sample`: the last row, or the last k+1 with k drafts), greedy
        picks and their logprobs copied towards pinned host memory."""
        if not chunks:
            return None
        n, starts, lens = self._fill(chunks)
        r = len(chunks)
        for h, d, m in ((self.h_ids, self.d_ids, n), (self.h_pos, self.d_pos, n), (self.h_slots, self.d_slots, n)):
            d[:m].copy_(h[:m], non_blocking=True)
        self.d_tables[:r].copy_(self.h_tables[:r], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.attn.prepare(self.d_slots[:n], starts, lens, self.d_tables[:r])
        hidden = self.model(self.d_ids[:n], self.d_pos[:n], self.attn)
        row_starts = [0] * r
        for i in range(1, r):
            row_starts[i] = row_starts[i - 1] + lens[i - 1]
        step = LaunchedStep(chunks, hidden, row_starts, [i for i, ch in enumerate(chunks) if ch.sample], [])
        if not step.picks:
            return step
        rows = []
        for i in step.picks:
            ch = chunks[i]
            first = row_starts[i] + ch.num_tokens - len(ch.drafts) - 1
            step.spans.append((len(rows), len(ch.drafts) + 1))
            rows.extend(range(first, first + len(ch.drafts) + 1))
        step.logits = self.model.compute_logits(hidden.index_select(0, to_device(rows, self.device)))
        step.logprobs = torch.log_softmax(step.logits.float(), dim=-1)
        best = step.logits.argmax(-1)
        best_lp = step.logprobs.gather(1, best[:, None])[:, 0]
        step.out, self.next_out = self.next_out, 1 - self.next_out
        m = len(rows)
        self.h_greedy[step.out][:m].copy_(best, non_blocking=True)
        self.h_logprob[step.out][:m].copy_(best_lp, non_blocking=True)
        if self.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    @torch.inference_mode()
    def collect(self, step: LaunchedStep, draft_probs: dict[str, torch.Tensor] | None = None) -> dict[str, Sampled]:
        """Wait for a launched step and return the tokens of its sampling chunks: one token, or with
        drafts the verified ones. `draft_probs`: the draft distributions of sampled requests.
        Afterwards `hidden` / `row_starts` describe this step (the drafter reads them)."""
        self.hidden, self.row_starts = step.hidden, step.row_starts
        if not step.picks:
            return {}
        if step.ready is not None:
            step.ready.synchronize()
        m = sum(k for _, k in step.spans)
        greedy = self.h_greedy[step.out][:m].tolist()
        greedy_lp = self.h_logprob[step.out][:m].tolist()
        out: dict[str, Sampled] = {}
        for i, (r0, k1) in zip(step.picks, step.spans):
            ch = step.chunks[i]
            req, p = ch.request, ch.request.params
            if p.greedy and p.repetition_penalty == 1.0:
                toks = verify_greedy(list(ch.drafts), greedy[r0 : r0 + k1]) if ch.drafts else [greedy[r0]]
                # Every accepted token is the argmax of its row, so its logprob is that row's maximum.
                out[req.request_id] = Sampled(toks, greedy_lp[r0 : r0 + len(toks)])
                continue
            logits = step.logits
            sampler = self.sampler(req)
            if ch.drafts:
                q = (draft_probs or {}).get(req.request_id)
                target = torch.stack([filtered_probs(logits[r0 + j], p) for j in range(k1)]).cpu()
                toks = verify_sampled(list(ch.drafts), q, target, sampler.gen)
            else:
                seen = torch.tensor(req.all_ids) if p.repetition_penalty != 1.0 else None
                toks = [sampler(logits[r0], seen)]
            lp = step.logprobs[r0 : r0 + len(toks)].gather(1, torch.tensor(toks, device=logits.device)[:, None])
            out[req.request_id] = Sampled(toks, lp[:, 0].tolist())
        return out
