"""What a step's logit rows become: each sampling row's token and logprob, the alternatives requests
ask for, and the host's verification of sampled drafts.

Greedy rows are the argmax (a graph computes it); rows of requests that sample, or that bias or
penalise their logits, are drawn on the device from counter-based noise (`DeviceSampler`: the seed and
the draw's index, so the same tokens whatever else is in the batch). A request whose rows cannot be
built fails alone: it is recorded in `faults` and its rows drawn as neutral greedy ones. Sampled rows
with drafts are verified on the host from the step's logits, against the distribution the request
samples from (speculative sampling).

`SamplingRequests` holds what belongs to requests rather than to a runner (their samplers, the
alternatives they ask for): a read stage's runner picks from the same one as the main runner.
"""

from __future__ import annotations

import logging

import torch

from strata.kernels.row_lse import row_logsumexp
from strata.kernels.transfer import to_device
from strata.params import MAX_TOP_LOGPROBS
from strata.runner.device_sampling import (DeviceSampler, RowParams, SamplePlan, filtered_probs_batched,
                                          output_penalties)
from strata.runner.steps import LaunchedStep, Sampled
from strata.sampling import (Sampler, apply_logit_bias, apply_output_penalties, apply_repetition_penalty,
                             filtered_probs)
from strata.speculative.verify import verify_greedy, verify_sampled

log = logging.getLogger("strata")

Top = tuple[torch.Tensor, torch.Tensor, int]  # ids [rows, k], logprobs [rows, k], k


class SamplingRequests:
    """Each request's sampler and the alternatives it asks for, kept until `release`."""

    def __init__(self, seed: int | None = None):
        self.seed, self.sampled_requests = seed, 0
        self.samplers: dict[str, Sampler] = {}
        self.top_logprobs: dict[str, int] = {}  # request id -> alternatives per token, for those asking
        # Requests whose logprobs and alternatives are under the distribution the token is drawn from
        # after temperature, top-k, top-p and min-p (llama-server's post_sampling_probs).
        self.filtered_logprobs: set[str] = set()

    def sampler(self, req) -> Sampler:
        """The request's sampler. With an engine seed, requests that bring none get seeds derived from
        it in arrival order, so a whole run is reproducible."""
        s = self.samplers.get(req.request_id)
        if s is None:
            default = None if self.seed is None else self.seed * 1_000_003 + self.sampled_requests
            self.sampled_requests += 1
            s = self.samplers[req.request_id] = Sampler(req.params, default)
        return s

    def want_top_logprobs(self, request_id: str, k: int, filtered: bool = False) -> None:
        """Report the `k` (1..20) most likely tokens of each of the request's rows with its tokens.
        `filtered`: the tokens' logprobs and the alternatives under the distribution after temperature,
        top-k, top-p and min-p (a filtered-out token's logprob is -inf), not the plain softmax."""
        if not 1 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [1, {MAX_TOP_LOGPROBS}], got {k}")
        self.top_logprobs[request_id] = k
        if filtered:
            self.filtered_logprobs.add(request_id)

    def release(self, request_id: str) -> None:
        self.samplers.pop(request_id, None)
        self.top_logprobs.pop(request_id, None)
        self.filtered_logprobs.discard(request_id)


class Picker:
    """One runner's picks: its device sampler (buffers for `rows` logit rows) over shared `requests`."""

    def __init__(self, requests: SamplingRequests, rows: int, vocab: int, device: torch.device, *, max_seen: int,
                 batch_invariant: bool = False):
        self.requests, self.device, self.batch_invariant = requests, device, batch_invariant
        self.dsampler = DeviceSampler(rows, vocab, device, max_seen=max_seen, batch_invariant=batch_invariant)
        # Requests whose rows of the step being launched failed to build: id -> why (see `_draw`).
        self.faults: dict[str, str] = {}

    def pick(self, logits: torch.Tensor, lse: torch.Tensor, chunks,
             greedy: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], Top | None]:
        """((tokens, logprobs), alternatives) of the logit rows of `chunks` (each chunk's drafts + 1 rows, in
        order). `greedy`: the rows' argmax and its logprob where a graph computed them already."""
        drawn = self._draw(logits, chunks)
        if drawn is not None:
            picked = drawn[:2]
        elif greedy is not None:
            picked = greedy
        else:
            best = logits.argmax(-1)
            picked = best, logits.gather(1, best[:, None])[:, 0] - lse
        top = self._top(logits, lse, chunks, drawn[2] if drawn else None)
        return self._filtered(logits, chunks, picked, top)

    def take_faults(self) -> dict[str, str]:
        """The faults of the step just picked; the next step starts with none."""
        faults, self.faults = self.faults, {}
        return faults

    def _draw(self, logits: torch.Tensor, chunks) -> tuple[torch.Tensor, torch.Tensor, SamplePlan] | None:
        """Tokens and logprobs of the rows of `chunks` (in logit-row order: each chunk's drafts + 1
        rows) through the device sampler, and its plan; None when every row is plain greedy (argmax
        serves). Rows of sampled requests with drafts are verified on the host from the logits; they
        get argmax here. A request whose rows cannot be built is recorded in `faults` and gets neutral
        (greedy) rows: its pick is dropped and the engine fails it alone."""
        if all(ch.request.params.greedy and ch.request.params.repetition_penalty == 1.0
               and not ch.request.params.logit_bias and not ch.request.params.output_penalised for ch in chunks):
            return None
        rows = []
        for ch in chunks:
            n = len(ch.drafts) + 1
            try:
                own = self._rows_of(ch)
            except Exception as e:  # its own parameters or state: the batch goes on without it
                log.warning("request %s: its sampling rows failed: %s: %s", ch.request.request_id, type(e).__name__, e)
                self.faults[ch.request.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                own = [RowParams() for _ in range(n)]
            rows.extend(own)
        plan = self.dsampler.fill(rows)
        return *self.dsampler.run(logits[: len(rows)], plan), plan

    def _rows_of(self, ch) -> list[RowParams]:
        """The device sampler's rows of one chunk, each checked against what the sampler can hold."""
        req, p = ch.request, ch.request.params
        seed = self.requests.sampler(req).seed
        done = len(req.output_ids) + ch.pending  # a pending token is drawn before this row's
        rows = []
        for j in range(len(ch.drafts) + 1):
            if ch.drafts and not p.greedy:
                rows.append(RowParams())
                continue
            seen = req.all_ids + list(ch.drafts[:j]) if p.repetition_penalty != 1.0 else None
            row = RowParams.of(p, seed, done + j, seen)
            if p.output_penalised:
                row.penalties = output_penalties(req.output_ids + list(ch.drafts[:j]), p.presence_penalty,
                                                 p.frequency_penalty)
            row.check(self.dsampler.vocab)
            rows.append(row)
        return rows

    def _top(self, logits: torch.Tensor, lse: torch.Tensor, chunks,
             plan: SamplePlan | None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(ids, logprobs, k): the k most likely tokens of every logit row of `chunks`, k the most any
        of their requests asks for; None when none asks. Under the distribution the picks' logprobs
        come from: the rows' log-softmax, of the biased and repetition-penalised logits where the device
        sampler biased or penalised (its parameter buffers still hold this step's)."""
        if not self.requests.top_logprobs:
            return None
        k = max((self.requests.top_logprobs.get(ch.request.request_id, 0) for ch in chunks), default=0)
        if not k:
            return None
        m = sum(len(ch.drafts) + 1 for ch in chunks)
        logits = logits[:m]
        if plan is None or not (plan.width or plan.bias):
            values, ids = logits.topk(k, dim=-1)
            return ids, values - lse[:m, None], k
        ds = self.dsampler
        ids = torch.empty(m, k, dtype=torch.long, device=logits.device)
        values = torch.empty(m, k, dtype=torch.float32, device=logits.device)
        for r0 in range(0, m, ds.chunk_rows):  # row blocks, as the sampler: [rows, V] temporaries
            r1 = min(m, r0 + ds.chunk_rows)
            x = ds.transformed(logits[r0:r1], r0, plan)
            v, i = x.topk(k, dim=-1)
            values[r0:r1], ids[r0:r1] = v - row_logsumexp(x, self.batch_invariant)[:, None], i
        return ids, values, k

    def _filtered(self, logits: torch.Tensor, chunks, picked: tuple[torch.Tensor, torch.Tensor],
                  top: tuple[torch.Tensor, torch.Tensor, int] | None):
        """(picked, top) with the rows of requests in `filtered_logprobs` under the filtered distribution:
        each pick's logprob and the row's alternatives (the ones drawn on the device; the host gives
        those of the rows it verifies)."""
        if not self.requests.filtered_logprobs or top is None:
            return picked, top
        rows, params, r0 = [], [], 0
        for ch in chunks:
            n, req = len(ch.drafts) + 1, ch.request
            if (req.request_id in self.requests.filtered_logprobs and req.request_id not in self.faults
                    and (req.params.greedy or not ch.drafts)):
                rows.extend(range(r0, r0 + n))
                params.extend(self._rows_of(ch))
            r0 += n
        if not rows:
            return picked, top
        idx = to_device(rows, self.device)
        logp = filtered_probs_batched(logits.index_select(0, idx), params).log()
        tokens, lps = picked[0], picked[1].clone()  # a graph's output buffer stays as the graph wrote it
        lps[idx] = logp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0]
        ids, values, k = top[0].clone(), top[1].clone(), top[2]
        values[idx], ids[idx] = logp.topk(k, dim=-1)
        return (tokens, lps), (ids, values, k)

    def results(self, step: LaunchedStep, greedy: list[int], greedy_lp: list[float], top,
                draft_probs: dict[str, torch.Tensor] | None) -> dict[str, Sampled]:
        """The tokens of a collected step's sampling chunks, from its picks on the host (`greedy`,
        `greedy_lp`; `top`: the alternatives' ids and logprobs as numpy arrays, or None): one token, or
        with drafts the verified ones."""
        out: dict[str, Sampled] = {}
        for i, (r0, k1) in zip(step.picks, step.spans):
            ch = step.chunks[i]
            req, p = ch.request, ch.request.params
            if req.request_id in step.faults:  # a placeholder pick: the engine fails the request
                out[req.request_id] = Sampled([greedy[r0]], [0.0])
                continue
            if p.greedy or not ch.drafts:
                # Drawn on the device (greedy rows: the argmax after any repetition penalty); a greedy
                # row's accepted tokens are each its row's pick.
                toks = verify_greedy(list(ch.drafts), greedy[r0 : r0 + k1]) if ch.drafts else [greedy[r0]]
                out[req.request_id] = Sampled(toks, greedy_lp[r0 : r0 + len(toks)],
                                              self._top_of(req.request_id, top, r0, len(toks)))
                continue
            logits = step.logits
            q = (draft_probs or {}).get(req.request_id)
            target = torch.stack([filtered_probs(self.penalised(logits[r0 + j], req, ch.drafts[:j]), p)
                                  for j in range(k1)]).cpu()
            toks = verify_sampled(list(ch.drafts), q, target, self.requests.sampler(req).gen)
            if req.request_id in self.requests.filtered_logprobs:
                logp = target[: len(toks)].log()
                v, a = logp.topk(self.requests.top_logprobs[req.request_id], dim=-1)
                out[req.request_id] = Sampled(toks, logp.gather(1, torch.tensor(toks)[:, None])[:, 0].tolist(),
                                              [list(zip(x, y)) for x, y in zip(a.tolist(), v.tolist())])
                continue
            idx = torch.tensor(toks, device=logits.device)
            rows = torch.arange(r0, r0 + len(toks), device=logits.device)
            lp = logits[rows, idx] - step.lse[rows]
            out[req.request_id] = Sampled(toks, lp.tolist(), self._top_of(req.request_id, top, r0, len(toks)))
        return out

    @staticmethod
    def penalised(row: torch.Tensor, req, drafts) -> torch.Tensor:
        """A verification row's logits under the request's logit bias and repetition penalty, the
        tokens before it (its drafts included) counting as seen: the same target a row without drafts
        samples from."""
        row = apply_logit_bias(row, req.params.logit_bias)
        row = apply_output_penalties(row, req.output_ids + list(drafts), req.params.presence_penalty,
                                     req.params.frequency_penalty)
        penalty = req.params.repetition_penalty
        if penalty == 1.0:
            return row
        seen = torch.tensor(req.all_ids + list(drafts), device=row.device)
        return apply_repetition_penalty(row, seen, penalty)


    def _top_of(self, request_id: str, top, r0: int, n: int) -> list[list[tuple[int, float]]] | None:
        """The request's alternatives for its rows r0 .. r0+n-1 (each token's own row: an accepted
        draft's, or the target's), from the pinned top buffers as numpy views."""
        k = self.requests.top_logprobs.get(request_id, 0)
        if top is None or not k:
            return None
        ids, lps = top[0][r0 : r0 + n, :k].tolist(), top[1][r0 : r0 + n, :k].tolist()
        return [list(zip(i, v)) for i, v in zip(ids, lps)]
