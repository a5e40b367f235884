"""The MTP drafter: keeps the MTP layer's K/V in step with the verified tokens and proposes drafts.

The MTP layer's row i combines the target's hidden state at position i with the token at position
i+1 and predicts the token at i+2; it has its own K/V layer in the pool (index `num_hidden_layers`),
at the same slots as the target's. After each step, for every request whose chunk sampled:

1. **K/V of the verified positions.** Rows from the first position without MTP K/V up to the
   position before the newest token are run through the MTP layer, fed the tokens that follow them
   (prompt tokens, accepted drafts, the newly sampled token). For a prompt, where those rows come
   from depends on the mode: by default the read stores its hidden states and the drafter runs the
   whole prompt when the read hands the slot over to decoding; with `STRATA_SPLIT_MTP_BATCH=1` every
   read chunk's rows run batched, chunk by chunk, right after the read's forward.
2. **Drafts.** The last row's logits give draft 1; the MTP layer then runs on its own output hidden
   state and draft j-1 to give draft j (DeepSeek-V3's recursion with one MTP layer), up to N drafts,
   stopping at the first whose probability under the MTP head is below `min_p`. Those rows' K/V sit
   past the verified tokens and are overwritten by the next step's rows (rollback by counter).

With `batch_mtp`, all requests' rows run as one batch per depth; without it, one request at a time.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from strata.env import ENV
from strata.kvcache.pool import KVPool
from strata.models.transformer import CausalLM
from strata.models.decoder import cpu_kernels
from strata.attention.registry import make_attention
from strata.sampling import filtered_probs
from strata.speculative.mtp_step import MTPStep
from strata.speculative.stats import SpecStats

log = logging.getLogger("strata")


class MTPDrafter:
    def __init__(self, model: CausalLM, pool: KVPool, *, max_drafts: int, min_p: float, batch_mtp: bool,
                 adaptive: bool, max_model_len: int, max_seqs: int, chunk_size: int, device: torch.device,
                 dtype: torch.dtype, seed_of: Callable[[Any], int], max_num_batched_tokens: int = 0,
                 cuda_graph: bool = True, host_pool: KVPool | None = None, split: bool | None = None):
        """`seed_of(request)`: the request's sampling seed; its drafts draw from the next one.
        `host_pool`: the host KV tier's pool (the MTP layer's K/V tier with the rest).
        `max_num_batched_tokens`: the most rows of a step (sizes the MTP call buffers).
        `split`: the prompt's MTP K/V chunk by chunk during the read (None: as STRATA_SPLIT_MTP_BATCH)."""
        if not model.mtp_layers:
            raise ValueError("speculation needs a model with an MTP head (num_nextn_predict_layers > 0)")
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.max_drafts, self.min_p, self.batch_mtp, self.adaptive = max_drafts, min_p, batch_mtp, adaptive
        self.max_model_len, self.chunk_size, self.seed_of = max_model_len, chunk_size, seed_of
        max_rows = max(chunk_size, max_num_batched_tokens, max_seqs * (1 + max_drafts))
        self.attn = make_attention(pool, model.config, max_seqs=max_seqs + 1, max_rows=max_rows,
                                   max_split_rows=max_seqs, device=self.device, dtype=dtype,
                                   max_context=max_model_len)
        if host_pool is not None:
            from strata.attention.reference import PagedAttention
            from strata.attention.tiered import TieredAttention

            # The Triton backend (layout tensors, an LSE output) on CUDA, the torch reference elsewhere.
            inner = self.attn if self.attn.meta is not None else PagedAttention(pool)
            self.attn = TieredAttention(inner, host_pool, device=self.device, decode_rows=1 + max_drafts,
                                        max_host_tokens=max_model_len, num_layers=0, cpu_kernels=cpu_kernels())
        self.step = MTPStep(model, pool, self.attn, max_seqs=max_seqs, max_rows=max_rows, rows_per_seq=1 + max_drafts,
                            max_model_len=max_model_len, device=self.device, dtype=dtype, cuda_graph=cuda_graph)
        self.split = self.split_mode() if split is None else split
        log.info("MTP draft K/V for prompts: %s", "batched with the read (STRATA_SPLIT_MTP_BATCH=1)" if self.split
                 else "by the drafter at hand-over (default)")
        # Default mode keeps each slot's prompt hidden states until the read hands over.
        self.prompt_hidden = None if self.split else torch.zeros(
            max_seqs, max_model_len, model.config.hidden_size, device=self.device, dtype=dtype)
        self.mtp_upto: dict[str, int] = {}  # positions whose MTP K/V are written
        self.draft_probs: dict[str, torch.Tensor] = {}  # sampled requests: q of each pending draft
        self.gens: dict[str, torch.Generator] = {}
        self.acceptance: dict[str, float] = {}  # running acceptance (adaptive draft length)
        self.stats: dict[str, SpecStats] = {}
        self.total = SpecStats(max_drafts)

    def capture_graphs(self) -> float:
        """The MTP call graphs (see `strata.speculative.mtp_step`); seconds taken, 0 without CUDA graphs."""
        return self.step.capture_graphs()

    @staticmethod
    def split_mode() -> bool:
        """STRATA_SPLIT_MTP_BATCH: prompt K/V batched with the read (else kept hidden states, at hand-over)."""
        return ENV.SPLIT_MTP_BATCH.get()

    def forget(self, request_id: str) -> SpecStats | None:
        for d in (self.mtp_upto, self.draft_probs, self.gens, self.acceptance):
            d.pop(request_id, None)
        return self.stats.pop(request_id, None)

    def reset(self, request_id: str) -> None:
        """After a preemption: everything is recomputed from position 0."""
        self.mtp_upto[request_id] = 0
        self.draft_probs.pop(request_id, None)

    # ---- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def after_step(self, chunks, hidden: torch.Tensor, row_starts: list[int], sampled: dict,
                   kv_written: dict[str, int] | None = None) -> None:
        """`kv_written`: request id -> positions whose MTP K/V the concurrent read's stage already wrote
        (STRATA_SPLIT_MTP_BATCH beside it): those read chunks need nothing more here."""
        rows_h: list[list[int]] = []  # per sequence, its rows in `hidden`
        seqs = []  # (request, first position, next-token ids, wants drafts)
        for i, ch in enumerate(chunks):
            req, s, r0 = ch.request, ch.start, row_starts[i]
            rid = req.request_id
            done = self.mtp_upto.get(rid, 0)
            if done < req.prefix_hit <= s:
                # The first chunk after a prefix-cache hit: the cached blocks hold their MTP K/V too
                # (their keys take the next token), so nothing before the hit needs hidden states.
                done = req.prefix_hit
            self.mtp_upto[rid] = done
            if not ch.sample:  # a read chunk that does not reach the end of the prompt
                if kv_written and rid in kv_written:
                    self.mtp_upto[rid] = kv_written[rid]
                elif self.split:
                    rows_h.append(list(range(r0, r0 + ch.num_tokens)))
                    seqs.append((req, s, req.token_ids(s + 1, s + ch.num_tokens + 1), False))
                else:
                    self.prompt_hidden[req.slot, s : s + ch.num_tokens] = hidden[r0 : r0 + ch.num_tokens]
                continue
            emitted = sampled[rid].tokens
            if ch.drafts:
                self._record(rid, len(ch.drafts), len(emitted) - 1)
            running = req.status.name == "RUNNING"
            n = ch.num_tokens - len(ch.drafts) + len(emitted) - 1  # verified rows of this chunk
            nxt = req.token_ids(s + 1, s + ch.num_tokens - len(ch.drafts)) + list(emitted)
            nxt = nxt[:n]
            if not running:
                continue
            if done < s:  # default mode: the read kept the prompt's earlier rows; run them now
                self._catch_up(req, done, s)
            rows_h.append(list(range(r0, r0 + n)))
            seqs.append((req, s, nxt, True))
        if not seqs:
            return
        self.draft_probs = {k: v for k, v in self.draft_probs.items() if k not in {q[0].request_id for q in seqs}}
        groups = [list(range(len(seqs)))] if self.batch_mtp else [[i] for i in range(len(seqs))]
        for g in groups:
            self.step.stage_rows(hidden, [row for i in g for row in rows_h[i]])
            self._run_group([seqs[i] for i in g])

    def _catch_up(self, req, start: int, end: int) -> None:
        """MTP K/V for prompt positions [start, end) from the stored hidden states, a read-chunk at a
        time so activations stay as small as the read's."""
        for c0 in range(start, end, self.chunk_size):
            c1 = min(c0 + self.chunk_size, end)
            self.step.stage_block(self.prompt_hidden[req.slot, c0:c1])
            self.step.run([req], [c0], [c1 - c0], req.token_ids(c0 + 1, c1 + 1))
        self.mtp_upto[req.request_id] = end

    def _record(self, rid: str, proposed: int, accepted: int) -> None:
        st = self.stats.setdefault(rid, SpecStats(self.max_drafts))
        st.record(proposed, accepted)
        self.total.record(proposed, accepted)
        prev = self.acceptance.get(rid, 1.0)
        self.acceptance[rid] = 0.7 * prev + 0.3 * (accepted / proposed)

    def _budget(self, req, last_pos: int) -> int:
        """How many drafts this request may get: N (or its adaptive share), bounded by the context
        and by the tokens it may still generate."""
        n = self.max_drafts
        if self.adaptive:
            n = max(1, min(n, 1 + round(self.acceptance.get(req.request_id, 1.0) * (n - 1))))
        left = req.params.max_tokens - len(req.output_ids) - 1
        return max(0, min(n, left, self.max_model_len - 2 - last_pos))

    def _picks(self, reqs, rows: list[int], logits: torch.Tensor, top: torch.Tensor,
               top_p: torch.Tensor) -> list[tuple[int, float, torch.Tensor | None]]:
        """One draft for request reqs[k] from row rows[k] of the call's outputs: greedy rows from the
        head's top token (one device round trip for all), sampled rows one by one."""
        tops, probs = torch.stack((top.double(), top_p.double())).tolist()
        return [(int(tops[i]), probs[i], None) if r.params.greedy else self._sample(r, logits[i])
                for r, i in zip(reqs, rows)]

    def _sample(self, req, logits: torch.Tensor) -> tuple[int, float, torch.Tensor]:
        p = req.params
        q = filtered_probs(logits, p).cpu()
        gen = self.gens.get(req.request_id)
        if gen is None:
            gen = self.gens[req.request_id] = torch.Generator()
            gen.manual_seed(self.seed_of(req) + 1)
        tok = int(torch.multinomial(q, 1, generator=gen))
        return tok, float(q[tok]), q

    def _run_group(self, seqs) -> None:
        """One MTP call over the verified rows of `seqs` (staged by the caller), then the drafting
        recursion: one row per still-drafting request per depth."""
        reqs = [q[0] for q in seqs]
        starts = [q[1] for q in seqs]
        lens = [len(q[2]) for q in seqs]
        h_last, logits, top, top_p = self.step.run(reqs, starts, lens, [t for q in seqs for t in q[2]])
        for r, s, n in zip(reqs, starts, lens):
            self.mtp_upto[r.request_id] = s + n
        budget = {j: self._budget(reqs[j], starts[j] + lens[j] - 1) for j in range(len(reqs)) if seqs[j][3]}
        drafts: dict[int, list[int]] = {j: [] for j in budget}
        qs: dict[int, list[torch.Tensor]] = {j: [] for j in budget}
        # (request index, its last position, its row in the latest call's outputs)
        active = [(j, starts[j] + lens[j] - 1, j) for j in budget if budget[j] > 0]
        while active:
            keep = []
            picks = self._picks([reqs[j] for j, _, _ in active], [row for _, _, row in active], logits, top, top_p)
            for (j, pos, row), (tok, prob, q) in zip(active, picks):
                if prob < self.min_p:
                    continue  # stop at the first draft the head is unsure of (it is not proposed)
                drafts[j].append(tok)
                if q is not None:
                    qs[j].append(q)
                if len(drafts[j]) < budget[j]:
                    keep.append((j, pos, row))
            if not keep:
                break
            self.step.stage_rows(h_last, [row for _, _, row in keep])
            h_last, logits, top, top_p = self.step.run([reqs[j] for j, _, _ in keep], [pos + 1 for _, pos, _ in keep],
                                                       [1] * len(keep), [drafts[j][-1] for j, _, _ in keep])
            active = [(j, pos + 1, k) for k, (j, pos, _) in enumerate(keep)]
        for j, d in drafts.items():
            reqs[j].draft_ids = d
            if qs[j]:
                self.draft_probs[reqs[j].request_id] = torch.stack(qs[j])
