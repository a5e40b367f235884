"""The MTP head on the last pipeline stage.

The MTP layer reads the main model's final hidden states, which the last stage computes; it embeds the
tokens it drafts from and applies the LM head. So the last stage holds it, with the embedding and the
head (`strata.models.held.elsewhere_prefixes`), keeps its K/V layer in its own pool and runs the drafter
(`MTPDrafter`, unchanged) on hidden states that never leave it: `DraftServer`.

Rank 0 samples and verifies. Its `StageDrafter` stands in for the drafter in the engine: once per
collected step it sends the last stage what the drafter reads (each sequence's chunk: start, rows,
drafts, whether it sampled; the tokens it emitted; its block table, prefix hit, sampling parameters and
seed; the tokens of the request the last stage has not seen yet, which it keeps), and gets back each
sequence's MTP K/V extent and drafts, and the draft distributions of sampled requests. Preemptions and
finished requests ride along with the next message. The step's hidden states are the ones the last
stage sent back for it, still in the ring slot they left from (`Link.slot_of`); the messages go in
order on the control channel, so a step's drafting runs after the steps launched before it.

The reply to a message none of whose chunks samples (prompt chunks read ahead) brings MTP K/V extents
only, which nothing needs at once: it is read before the next message (or a reset or forget), not
waited for. Waiting would hold rank 0 until the last stage had computed every step launched after that
one, so no stage would compute the prompt's next chunk meanwhile.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from strata.dist.link import HEADER, INLINE, OP_DRAFT, TAG_CTRL, TAG_DRAFT, TAG_PROBS, Link
from strata.params import SamplingParams
from strata.sched.request import RequestStatus
from strata.speculative.drafter import MTPDrafter
from strata.speculative.stats import SpecStats

# A sequence's words: request key, slot, chunk start, rows, samples, drafts, first row in the hidden
# states, prefix hit, running, tokens emitted, MTP K/V the read wrote (-1: none), block table length,
# tokens sent so far (the new ones follow), tokens generated, max tokens, seed, temperature, top-k,
# top-p, min-p, new tokens. Floats as float64 bits.
SEQ = 21
(K_KEY, K_SLOT, K_START, K_ROWS, K_SAMPLE, K_DRAFTS, K_ROW0, K_HIT, K_RUNNING, K_EMITTED, K_WRITTEN, K_TABLE,
 K_SYNCED, K_OUTPUT, K_MAX, K_SEED, K_TEMP, K_TOPK, K_TOPP, K_MINP, K_NEW) = range(SEQ)
# Header of a drafting message (HEADER words): op, sequences, words, slot, resets, forgets.


def _message_words(max_seqs: int, max_drafts: int, max_blocks: int, max_model_len: int) -> int:
    """Header, the resets and forgets a message carries at most, each sequence's words, emitted tokens
    and block table, and its new tokens (a whole prompt and output the first time)."""
    return (HEADER + INLINE + 8 * max_seqs + max_seqs * (SEQ + 1 + max_drafts + max_blocks)
            + max_seqs * (max_model_len + 1 + max_drafts))


class StageDrafter:
    """Rank 0's drafter when the MTP head is the last stage's (the interface the engine uses of
    `MTPDrafter`: after_step, reset, forget, mtp_upto, draft_probs, stats, total, capture_graphs)."""

    def __init__(self, link: Link, *, max_drafts: int, max_seqs: int, max_blocks: int, max_model_len: int,
                 vocab_size: int, split: bool):
        self.link, self.max_drafts, self.split = link, max_drafts, split
        self.max_seqs = max_seqs
        self.buf = torch.zeros(_message_words(max_seqs, max_drafts, max_blocks, max_model_len), dtype=torch.int64)
        self.np = self.buf.numpy()
        self.reply = torch.zeros(max_seqs * (2 + max_drafts), dtype=torch.int64)
        self.probs = torch.zeros(max_seqs * max_drafts, vocab_size, dtype=torch.float32)
        self.keys: dict[str, int] = {}  # request id -> its key on the last stage
        self.synced: dict[str, int] = {}  # request id -> its tokens the last stage has
        self.next_key = 0
        self.resets: list[int] = []
        self.forgets: list[int] = []
        self.mtp_upto: dict[str, int] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.stats: dict[str, SpecStats] = {}
        self.total = SpecStats(max_drafts)
        self.sends: list = []
        self.pending: tuple | None = None  # (the receive, request ids) of a reply not read yet

    def capture_graphs(self) -> float:
        return 0.0  # the MTP call graphs are the last stage's

    def reset(self, request_id: str) -> None:
        self._take_reply()
        self.mtp_upto[request_id] = 0
        self.draft_probs.pop(request_id, None)
        if request_id in self.keys:
            self.resets.append(self.keys[request_id])

    def forget(self, request_id: str) -> SpecStats | None:
        self._take_reply()
        for d in (self.mtp_upto, self.draft_probs, self.synced):
            d.pop(request_id, None)
        key = self.keys.pop(request_id, None)
        if key is not None:
            self.forgets.append(key)
        return self.stats.pop(request_id, None)

    def _record(self, rid: str, proposed: int, accepted: int) -> None:
        self.stats.setdefault(rid, SpecStats(self.max_drafts)).record(proposed, accepted)
        self.total.record(proposed, accepted)

    @torch.inference_mode()
    def after_step(self, chunks, hidden: torch.Tensor, row_starts: list[int], sampled: dict,
                   kv_written: dict[str, int] | None = None) -> None:
        link = self.link
        slot = link.slot_of(hidden)
        self._take_reply()
        self._settle()
        m, o = self.np, HEADER
        cap = 4 * self.max_seqs
        resets, self.resets = self.resets[:cap], self.resets[cap:]
        forgets, self.forgets = self.forgets[:cap], self.forgets[cap:]
        m[o : o + len(resets)] = resets
        o += len(resets)
        m[o : o + len(forgets)] = forgets
        o += len(forgets)
        s = len(chunks)
        rec = m[o : o + SEQ * s].reshape(s, SEQ)
        floats = rec.view(np.float64)
        o += SEQ * s
        touched = []
        for j, ch in enumerate(chunks):
            req = ch.request
            rid = req.request_id
            key = self.keys.get(rid)
            if key is None:
                key = self.keys[rid] = self.next_key
                self.next_key += 1
            p = req.params
            emitted = sampled[rid].tokens if ch.sample else ()
            running = req.status == RequestStatus.RUNNING
            if ch.sample and ch.drafts:
                self._record(rid, len(ch.drafts), len(emitted) - 1)
            if (ch.sample and running) or (not ch.sample and self.split and not (kv_written and rid in kv_written)):
                touched.append(rid)
            synced = self.synced.get(rid, 0)
            total = req.num_tokens
            rec[j, :K_TEMP] = (key, -1 if req.slot is None else req.slot, ch.start, ch.num_tokens, ch.sample,
                               len(ch.drafts), row_starts[j], req.prefix_hit, running, len(emitted),
                               (kv_written or {}).get(rid, -1), len(req.block_ids), synced, len(req.output_ids),
                               p.max_tokens, self._seed(req))
            floats[j, K_TEMP] = p.temperature
            rec[j, K_TOPK] = p.top_k
            floats[j, K_TOPP] = p.top_p
            floats[j, K_MINP] = p.min_p
            rec[j, K_NEW] = total - synced
            m[o : o + len(emitted)] = emitted
            o += len(emitted)
            m[o : o + len(req.block_ids)] = req.block_ids
            o += len(req.block_ids)
            new = req.token_ids(synced, total)
            m[o : o + len(new)] = new
            o += len(new)
            self.synced[rid] = total
        m[:6] = (OP_DRAFT, s, o, slot, len(resets), len(forgets))
        last = link.last
        with link.lock:  # the concurrent read's thread posts its steps' messages on the same channel
            self.sends.append(link._isend(self.buf[: HEADER + INLINE], last, link.ctrl, TAG_CTRL))
            if o > HEADER + INLINE:
                self.sends.append(link._isend(self.buf[HEADER + INLINE : o], last, link.ctrl, TAG_CTRL))
        if not s:
            return
        w = 2 + self.max_drafts
        reply = self.reply[: s * w]
        for rid in touched:
            self.draft_probs.pop(rid, None)
        if any(ch.sample for ch in chunks):
            self._drafts_back(chunks, reply.view(s, w))
        else:
            self.pending = (link._irecv(reply, last, link.ctrl, TAG_DRAFT), [ch.request.request_id for ch in chunks])
        if self.resets or self.forgets:  # more than one message holds: the rest go with no sequence
            self.after_step([], hidden, [], {})

    def _drafts_back(self, chunks, reply: torch.Tensor) -> None:
        """Wait for the reply: each sequence's MTP K/V extent and drafts (with their distributions for
        sampled requests)."""
        link, last = self.link, self.link.last
        link._recv(reply, last, link.ctrl, TAG_DRAFT)
        words = reply.tolist()
        rows = [(ch.request, r[1]) for ch, r in zip(chunks, words) if r[1] > 0 and not ch.request.params.greedy]
        n = sum(k for _, k in rows)
        if n:
            link._recv(self.probs[:n], last, link.ctrl, TAG_PROBS)
        r0 = 0
        for req, k in rows:
            self.draft_probs[req.request_id] = self.probs[r0 : r0 + k].clone()
            r0 += k
        for ch, (upto, nd, *drafts) in zip(chunks, words):
            self.mtp_upto[ch.request.request_id] = upto
            if nd >= 0:
                ch.request.draft_ids = drafts[:nd]

    def _take_reply(self) -> None:
        """Read the pending reply: its chunks' MTP K/V extents."""
        if self.pending is None:
            return
        work, rids = self.pending
        self.pending = None
        self.link._wait(work, self.link.last)
        w = 2 + self.max_drafts
        for rid, upto in zip(rids, self.reply[: len(rids) * w].view(len(rids), w)[:, 0].tolist()):
            if rid in self.keys:  # not forgotten since
                self.mtp_upto[rid] = upto

    def _settle(self) -> None:
        for w in self.sends:
            self.link._wait(w, self.link.last)
        self.sends.clear()

    def _seed(self, req) -> int:
        """The request's sampling seed as a signed 64-bit word (torch seeds are unsigned)."""
        seed = self.link.runner.sampling.sampler(req).seed if not req.params.greedy else 0
        return seed - (1 << 64) if seed >= 1 << 63 else seed


class _Remote:
    """A request as the last stage's drafter reads it (`MTPDrafter` and `MTPStep` use these fields)."""

    host_blocks: list[int] = []

    def __init__(self, key: int):
        self.request_id = key
        self.tokens: list[int] = []
        self.draft_ids: list[int] | None = None
        self.params: SamplingParams | None = None
        self.param_words: tuple = ()

    def token_ids(self, start: int, stop: int) -> list[int]:
        return self.tokens[start:stop]


class _Chunk:
    __slots__ = ("request", "start", "num_tokens", "sample", "drafts")

    def __init__(self, request, start: int, num_tokens: int, sample: bool, drafts: int):
        self.request, self.start, self.num_tokens, self.sample = request, start, num_tokens, sample
        self.drafts = [0] * drafts  # the drafter reads their count; the accepted ones are in the tokens


class _Emitted:
    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]):
        self.tokens = tokens


class DraftServer:
    """The last stage's drafter, fed by rank 0's `StageDrafter`."""

    def __init__(self, drafter: MTPDrafter, ctrl, max_seqs: int, max_drafts: int, max_blocks: int,
                 max_model_len: int):
        self.drafter, self.ctrl, self.max_drafts = drafter, ctrl, max_drafts
        self.buf = torch.zeros(_message_words(max_seqs, max_drafts, max_blocks, max_model_len), dtype=torch.int64)
        self.reply = torch.zeros(max_seqs * (2 + max_drafts), dtype=torch.int64)
        self.probs = torch.zeros(max_seqs * max_drafts, drafter.model.config.vocab_size, dtype=torch.float32)
        self.reqs: dict[int, _Remote] = {}

    @torch.inference_mode()
    def serve(self, head: torch.Tensor, hidden: list[torch.Tensor]) -> None:
        """One drafting message (`head`: its first HEADER + INLINE words, already received); `hidden[slot]`:
        the final hidden states each ring slot last sent back."""
        m = self.buf.numpy()
        _, s, words, slot, nr, nf = head[:6].tolist()
        self.buf[: HEADER + INLINE].copy_(head)
        if words > HEADER + INLINE:
            dist.recv(self.buf[HEADER + INLINE : words], 0, group=self.ctrl, tag=TAG_CTRL)
        d, o = self.drafter, HEADER
        for key in m[o : o + nr].tolist():
            d.reset(key)
        o += nr
        for key in m[o : o + nf].tolist():
            d.forget(key)
            self.reqs.pop(key, None)
        o += nf
        if not s:
            return
        rec = m[o : o + SEQ * s].reshape(s, SEQ)
        floats = rec.view(np.float64)
        o += SEQ * s
        chunks, row_starts, sampled, written = [], [], {}, {}
        for j, w in enumerate(rec.tolist()):
            key = w[K_KEY]
            r = self.reqs.get(key)
            if r is None:
                r = self.reqs[key] = _Remote(key)
            r.slot, r.prefix_hit = (None if w[K_SLOT] < 0 else w[K_SLOT]), w[K_HIT]
            r.status = RequestStatus.RUNNING if w[K_RUNNING] else RequestStatus.WAITING
            r.output_ids = range(w[K_OUTPUT])  # the drafter reads how many
            seed = w[K_SEED]
            r.seed = seed + (1 << 64) if seed < 0 else seed
            params = (w[K_MAX], float(floats[j, K_TEMP]), w[K_TOPK], float(floats[j, K_TOPP]),
                      float(floats[j, K_MINP]))
            if params != r.param_words:
                r.params = SamplingParams(max_tokens=params[0], temperature=params[1], top_k=params[2],
                                          top_p=params[3], min_p=params[4])
                r.param_words = params
            emitted = m[o : o + w[K_EMITTED]].tolist()
            o += w[K_EMITTED]
            r.block_ids = m[o : o + w[K_TABLE]].tolist()
            o += w[K_TABLE]
            del r.tokens[w[K_SYNCED] :]
            r.tokens.extend(m[o : o + w[K_NEW]].tolist())
            o += w[K_NEW]
            r.draft_ids = None
            chunks.append(_Chunk(r, w[K_START], w[K_ROWS], bool(w[K_SAMPLE]), w[K_DRAFTS]))
            row_starts.append(w[K_ROW0])
            if w[K_SAMPLE]:
                sampled[key] = _Emitted(emitted)
            if w[K_WRITTEN] >= 0:
                written[key] = w[K_WRITTEN]
        d.draft_probs.clear()
        d.after_step(chunks, hidden[slot], row_starts, sampled, written or None)
        wd = 2 + self.max_drafts
        reply = self.reply.numpy()[: s * wd].reshape(s, wd)
        rows = []
        for j, ch in enumerate(chunks):
            r = ch.request
            drafts = r.draft_ids
            nd = -1 if drafts is None else len(drafts)
            reply[j, 0] = d.mtp_upto.get(r.request_id, 0)
            reply[j, 1] = nd
            if nd > 0:
                reply[j, 2 : 2 + nd] = drafts
                q = d.draft_probs.get(r.request_id)
                if q is not None:
                    rows.append(q)
        dist.send(self.reply[: s * wd], 0, group=self.ctrl, tag=TAG_DRAFT)
        if rows:
            n = 0
            for q in rows:
                self.probs[n : n + q.shape[0]].copy_(q)
                n += q.shape[0]
            dist.send(self.probs[:n], 0, group=self.ctrl, tag=TAG_PROBS)
        d.draft_probs.clear()
