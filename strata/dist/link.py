"""Rank 0's side of the pipeline.

Rank 0 runs the engine: its model holds the embedding, its own decoder layers and, where the next
stage's layers begin, a `StageBoundary`. When a step's forward reaches it, the boundary posts the step's
metadata (positions, K/V slots, per sequence the first position and row count, block tables; for a
hybrid model the linear-attention spans and the states to restore after rejected drafts) to every
other stage over the control group, the hidden state and residual stream to stage 1, and a receive of
the step's final hidden states (normed by the last stage) — and returns. The runner samples when it
collects the step (`receive`), so rank 0 launches the next step, its own layers, while this one runs
on the later stages: another batch group's decodes, or the same prompt's next chunk (the scheduler's
read-ahead), so that every stage computes at once.

Steps in flight are told apart by their slot in a ring of buffers (`ring_slots`): the decode loop's
steps go round `depth` of them, one per stage and at least two (a group's step in flight while the next
group's is launched; one prompt's chunks read ahead, one on each stage), the concurrent read's take the
last. The engine keeps at most `depth` steps out, so a slot is reused only after its step is collected.
Every message lands in, or leaves from, buffers allocated when the link is attached; gloo's send waits
until the peer has posted its receive, so rank 0 posts every send without waiting (`isend`) and waits
for a slot's earlier sends only when it reuses the slot.

With CUDA graphs, rank 0's decode graphs hold its layers up to the boundary, which copies the hidden
states into static buffers (`capturing`); the sends follow each replay (`send_replayed`), and the
step's head graph runs over the hidden states that come back.

The MTP head is the last stage's (`strata.dist.draft`): rank 0 tells it, once per collected step,
which tokens were accepted, and gets the drafts back.

A stage that dies ends this process with an error naming it (`fatal`): its own children are watched,
and a failed send or receive (a peer's socket closed) is fatal too, instead of a hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from strata.dist.plan import StagePlan
from strata.env import ENV

log = logging.getLogger("strata")

OP_STEP, OP_STOP, OP_DRAFT, OP_MEMORY = 1, 2, 3, 4
# int64 words: op, rows, sequences, table width, metadata words, state spans, state restores, slot, step
HEADER = 10
# A step's control message: the header and up to INLINE words of metadata, in one send (a decode step's
# fit); a larger step's remainder follows in a second. Each message costs a round of scheduling latency.
INLINE = 1024
# int64 words: blocks, rows, sequences, context, split rows, blocks per table, block size, linear-attention
# states (0: no hybrid), their verification rows, drafts per step (0: no MTP head), the drafter's prompt
# mode (`MTPDrafter.split_mode`), ring slots
GEOMETRY = 12
SPAN = 5  # a state span's words: first row, rows, state index, fresh, keep (`StatePool.set_spans`)
# Placement at start-up: a stage's budget, then its plan: K/V tokens it may hold (-1: no plan), budget,
# scratch, allocator cap (-1: none), MoE layers with their routed experts in RAM and those layers.
PLACE = 6
TAG_CTRL, TAG_DRAFT, TAG_PROBS, TAG_START, TAG_MEMORY = 1, 2, 3, 4, 5
TAG_DATA, TAG_BACK = 16, 32  # + the step's slot
# A stage's K/V capacity word when it refuses to run what it loaded; its reason follows (UTF-8, REASON bytes).
REFUSED, REASON = -1, 1024
# What a stage reports of torch's caching allocator on its device (`Link.memory`): zeros off CUDA.
MEMORY_KEYS = ("reserved_bytes.all.current", "segment.all.current", "allocated_bytes.all.current",
               "num_alloc_retries")


def fatal(message: str) -> None:
    """End the process at once: a pipeline with a stage gone cannot compute any step."""
    print(f"strata: error: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


def pipeline_depth(world: int) -> int:
    """Steps the decode loop may have in flight at once: one per stage, at least two (batch groups)."""
    return max(2, world)


def ring_slots(world: int) -> int:
    """Ring slots per stage: the decode loop's `pipeline_depth`, then the concurrent read's."""
    return pipeline_depth(world) + 1


def meta_words(max_rows: int, max_seqs: int, max_blocks: int, num_states: int = 0) -> int:
    """The control buffer's size: header, positions, slots, starts, lens, block tables, state spans (at
    most one per state) and restores (at most one per state: a later one replaces an earlier)."""
    return HEADER + max(INLINE, 2 * max_rows + max_seqs * (2 + max_blocks) + num_states * (SPAN + 2))


def split_hidden(buf: torch.Tensor, n: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the message, hidden states [n, H], residual stream [n, H]): both in one contiguous send."""
    msg = buf[: 2 * n * hidden]
    return msg, msg[: n * hidden].view(n, hidden), msg[n * hidden :].view(n, hidden)


def memory_counters(device: torch.device) -> torch.Tensor:
    """This process's `MEMORY_KEYS` on `device`, as int64 words."""
    if device.type != "cuda":
        return torch.zeros(len(MEMORY_KEYS), dtype=torch.int64)
    stats = torch.cuda.memory_stats(device)
    return torch.tensor([stats.get(k, 0) for k in MEMORY_KEYS], dtype=torch.int64)


def exit_reason(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class Trace:
    """`STRATA_STAGE_TRACE=DIR`: each rank appends `EVENT STEP SLOT` lines to DIR/stage{rank}.trace as it
    posts and completes its sends and receives (`send`, `back` on rank 0; `in`, `out` on a stage; `replay`
    after a graph's). Off: one attribute test per event."""

    def __init__(self, rank: int):
        where = ENV.STAGE_TRACE.get()
        self.file = open(os.path.join(where, f"stage{rank}.trace"), "a", buffering=1) if where else None

    def __call__(self, event: str, step: int, slot: int) -> None:
        if self.file is not None:
            self.file.write(f"{event} {step} {slot}\n")


def read_trace(where: str, rank: int) -> list[tuple[str, int, int]]:
    """A rank's trace as (event, step, slot) tuples, in its order."""
    path = os.path.join(where, f"stage{rank}.trace")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(e, int(a), int(b)) for e, a, b in (line.split() for line in f if line.strip())]


class StageBoundary(nn.Module):
    """Where rank 0's model hands its hidden states to the other stages."""

    held_elsewhere = True

    def __init__(self, link: "Link", layer_idx: int):
        super().__init__()
        self.link = link
        self.layer_idx = layer_idx

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope, attn):
        link = self.link
        if link.capturing:  # a CUDA graph of rank 0's layers: the sends follow each replay (`send_replayed`)
            link.g_x[: x.shape[0]].copy_(x)
            link.g_res[: x.shape[0]].copy_(residual)
        else:
            link.send_step(x, residual)
        return x, residual  # what rank 0's forward makes of them is not read: the last stage's come back


@dataclass
class InFlight:
    """A step whose hidden states are on the later stages (`LaunchedStep.remote`)."""

    slot: int
    rows: int
    step: int
    recv: object  # the receive's Work


class _Lane:
    """A runner's step being launched (the boundary reads its layout from the runner's host buffers)."""

    runner: object = None
    seqs: int = 0
    handle: InFlight | None = None


class Link:
    def __init__(self, plan: StagePlan, ctrl, data, children: list[tuple[int, subprocess.Popen]]):
        """`ctrl`: the gloo group of the metadata (host tensors); `data`: the hidden states' group (NCCL
        on GPUs, the same gloo group on the CPU). `children`: (rank, process) of the stages this process
        started."""
        self.plan, self.ctrl, self.data, self.children = plan, ctrl, data, children
        self.last = plan.world - 1
        self.runner = None
        self.steps = 0
        self.stopping = False
        self.watch = None
        self.trace = Trace(plan.rank)
        # The decode loop and the concurrent read's worker launch steps from two threads: one posts a
        # step's messages at a time, so every stage sees them in one order.
        self.lock = threading.Lock()
        self.lane = threading.local()
        self.depth = pipeline_depth(plan.world)
        self.slots = ring_slots(plan.world)
        self.read_slot = self.slots - 1
        self.next_slot = 0
        self.capturing = False  # the runner is capturing its graphs (`StageBoundary`)
        if children:
            self.watch = threading.Thread(target=self._watch, name="strata-stage-watch", daemon=True)
            self.watch.start()
        atexit.register(self.stop)

    # ---- start-up ---------------------------------------------------------------------------------
    def engine_config(self, cfg):
        """Rank 0's engine config: its stage's device; no run-ahead (a step samples only when its hidden
        states are back, after the next is launched)."""
        import dataclasses

        return dataclasses.replace(cfg, device=self.plan.device, async_scheduling=False)

    def install(self, model: nn.Module) -> None:
        """Put the boundary where rank 0's layers end (the loader left placeholders from there on)."""
        k = self.plan.layers[1]
        model.model.layers[k] = StageBoundary(self, k)
        log.info("pipeline: %d stages (%s)", self.plan.world, self.plan.describe())

    def budgets(self) -> list[int]:
        """Every other stage's GPU budget in bytes (0 on the CPU), as each measured it."""
        out = []
        buf = torch.zeros(1, dtype=torch.int64)
        for r in range(1, self.plan.world):
            self._recv(buf, r, self.ctrl, TAG_START)
            out.append(int(buf[0]))
        return out

    def place(self, placements: list["StagePlacement"], num_layers: int) -> None:
        """Give every other stage its placement (`placements[r]` is rank r's)."""
        for r in range(1, self.plan.world):
            self._send(placements[r].words(num_layers), r, self.ctrl, TAG_START)

    def kv_tokens(self, own: int) -> int:
        """The K/V tokens every stage can hold: rank 0's `own` and each stage's, measured after its load. A
        stage that refuses what it loaded (`check_batch_invariant` on its own layers) sends its reason
        instead: every stage is stopped, and the reasons raised as a ValueError."""
        buf = torch.zeros(1, dtype=torch.int64)
        tokens, refusals = own, []
        for r in range(1, self.plan.world):
            self._recv(buf, r, self.ctrl, TAG_START)
            if int(buf[0]) == REFUSED:
                reason = torch.zeros(REASON, dtype=torch.uint8)
                self._recv(reason, r, self.ctrl, TAG_START)
                a, b = self.plan.ranges[r]
                text = bytes(reason.tolist()).rstrip(b"\0").decode(errors="replace")
                refusals.append(f"pipeline stage {r} (layers {a}-{b - 1}): {text}")
                continue
            if int(buf[0]) < tokens:
                log.info("pipeline: stage %d holds K/V for %d tokens (rank 0: %d)", r, int(buf[0]), own)
            tokens = min(tokens, int(buf[0]))
        if refusals:
            self.stop()
            raise ValueError("; ".join(refusals))
        return tokens

    def attach(self, runner, num_blocks: int, max_model_len: int, max_split_rows: int, spec: int = 0,
               split_mtp: bool = False) -> None:
        """Give every stage the pool's and the step buffers' sizes, wait until each has built them, and
        allocate rank 0's own buffers. `spec`: drafts per step (the last stage's MTP head makes them)."""
        self.runner = runner
        self.block_size = runner.pool.block_size
        max_rows, max_seqs, max_blocks = runner.h_ids.shape[0], runner.h_tables.shape[0], runner.h_tables.shape[1]
        self.states = states = runner.attn.states
        num_states, verify_rows = (states.num_states, states.verify_rows) if states is not None else (0, 0)
        geometry = torch.tensor([num_blocks, max_rows, max_seqs, max_model_len, max_split_rows, max_blocks,
                                 self.block_size, num_states, verify_rows, spec, int(split_mtp), self.slots],
                                dtype=torch.int64)
        for r in range(1, self.plan.world):
            self._send(geometry, r, self.ctrl, TAG_CTRL)
        ready = torch.zeros(1, dtype=torch.int64)
        for r in range(1, self.plan.world):
            self._recv(ready, r, self.ctrl, TAG_CTRL)
        self.hidden = hidden = runner.model.config.hidden_size
        dtype, device = runner.model.model.embed_tokens.weight.dtype, runner.device
        self.dtype = dtype
        # Stages sharing a GPU talk over gloo, which sends host tensors: their hidden states go through
        # pinned host buffers (a device twin holds what comes back).
        self.via_host = device.type == "cuda" and dist.get_backend(self.data) == "gloo"
        where = dict(device="cpu", pin_memory=True) if self.via_host else dict(device=device)
        slots = self.slots
        self.out = [torch.zeros(2 * max_rows * hidden, dtype=dtype, **where) for _ in range(slots)]
        self.back = [torch.zeros(max_rows * hidden, dtype=dtype, **where) for _ in range(slots)]
        self.back_dev = ([torch.zeros(max_rows * hidden, dtype=dtype, device=device) for _ in range(slots)]
                         if self.via_host else self.back)
        # What rank 0's graphs leave at the boundary, sent after each replay.
        self.g_x, self.g_res = (torch.zeros(max_rows, hidden, dtype=dtype, device=device) for _ in range(2))
        words = meta_words(max_rows, max_seqs, max_blocks, num_states)
        self.meta = [torch.zeros(words, dtype=torch.int64) for _ in range(slots)]
        self.np_meta = [m.numpy() for m in self.meta]
        self.sends: list[list] = [[] for _ in range(slots)]  # each slot's sends still in flight
        self.recvs: list[InFlight | None] = [None] * slots  # each slot's step not yet received
        # Per state, the verification row to go back to before the next step (-1: none).
        self.restores = torch.full((num_states,), -1, dtype=torch.int64).numpy()
        self._tap_restores()
        runner.pipeline = self
        log.info("pipeline: every stage ready (%d blocks of K/V each)", num_blocks)

    def lane_for(self, runner) -> None:
        """Let `runner` (the concurrent read's) launch steps through the pipeline too, in the read's slot."""
        runner.pipeline = self

    def _tap_restores(self) -> None:
        if self.states is None:
            return
        link, restore = self, self.states.restore

        def tapped_restore(state: int, row: int) -> None:
            # The runner restores after the step's forward: the stages do so before their next step,
            # the first that can read the state again (whichever lane sends it).
            with link.lock:
                link.restores[state] = row
            restore(state, row)

        self.states.restore = tapped_restore

    # ---- a step -----------------------------------------------------------------------------------
    def begin(self, runner, seqs: int) -> None:
        """The runner's step about to run its forward: `seqs` sequences laid out in its host buffers."""
        lane = getattr(self.lane, "state", None)
        if lane is None:
            lane = self.lane.state = _Lane()
        lane.runner, lane.seqs, lane.handle = runner, seqs, None

    def launched(self) -> InFlight:
        """The step the runner's forward just sent on (for its `LaunchedStep`)."""
        lane = self.lane.state
        handle, lane.handle = lane.handle, None
        return handle

    def send_replayed(self, n: int) -> None:
        """Send the step whose rank-0 graph just replayed (its `n` rows' hidden states at the boundary)."""
        self.send_step(self.g_x[:n], self.g_res[:n])
        handle = self.lane.state.handle
        self.trace("replay", handle.step, handle.slot)

    def send_step(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        lane = self.lane.state
        rn, n, r = lane.runner, x.shape[0], lane.seqs
        lens, ctx = rn.np_meta[1, :r], rn.np_meta[2, :r]
        width = -(-int(ctx.max()) // self.block_size)
        with self.lock:
            if rn is self.runner:
                slot, self.next_slot = self.next_slot, (self.next_slot + 1) % self.depth
            else:
                slot = self.read_slot
            self._settle(slot)
            m, o = self.np_meta[slot], HEADER
            m[o : o + n] = rn.np_pos[:n]
            o += n
            m[o : o + n] = rn.np_slots[:n]
            o += n
            m[o : o + r] = ctx - lens
            o += r
            m[o : o + r] = lens
            o += r
            m[o : o + r * width] = rn.np_tables[:r, :width].reshape(-1)
            o += r * width
            k = undo = 0
            states = rn.attn.states
            if states is not None:
                spans = states.spans
                k = min(len(spans), r)  # a graph's step lists its padding rows' spans after its sequences
                if k:
                    m[o : o + SPAN * k].reshape(k, SPAN)[:] = spans[:k]
                o += SPAN * k
                (todo,) = (self.restores >= 0).nonzero()
                undo = len(todo)
                m[o : o + 2 * undo : 2] = todo
                m[o + 1 : o + 2 * undo : 2] = self.restores[todo]
                self.restores[todo] = -1
                o += 2 * undo
            step = self.steps
            self.steps += 1
            m[:HEADER] = (OP_STEP, n, r, width, o, k, undo, slot, step, 0)
            meta, sends = self.meta[slot], self.sends[slot]
            for s in range(1, self.plan.world):
                sends.append(self._isend(meta[: HEADER + INLINE], s, self.ctrl, TAG_CTRL))
                if o > HEADER + INLINE:
                    sends.append(self._isend(meta[HEADER + INLINE : o], s, self.ctrl, TAG_CTRL))
            out, xo, ro = split_hidden(self.out[slot], n, self.hidden)
            xo.copy_(x)
            ro.copy_(residual)
            sends.append(self._isend(out, 1, self.data, TAG_DATA + slot))
            recv = self._irecv(self.back[slot][: n * self.hidden], self.last, self.data, TAG_BACK + slot)
            self.recvs[slot] = lane.handle = InFlight(slot, n, step, recv)
            self.trace("send", step, slot)

    def receive(self, handle: InFlight) -> torch.Tensor:
        """Wait for a step's final hidden states (normed, [rows, H]) from the last stage."""
        n, slot = handle.rows, handle.slot
        self._wait(handle.recv, self.last)
        with self.lock:
            if self.recvs[slot] is handle:
                self.recvs[slot] = None
        self.trace("back", handle.step, slot)
        back = self.back[slot][: n * self.hidden]
        if self.via_host:
            self.back_dev[slot][: n * self.hidden].copy_(back)
        return self.back_dev[slot][: n * self.hidden].view(n, self.hidden)

    def slot_of(self, hidden: torch.Tensor) -> int:
        """The slot whose received hidden states `hidden` is (the drafter names it to the last stage)."""
        ptr = hidden.data_ptr()
        for s in range(self.slots):
            if self.back_dev[s].data_ptr() == ptr:
                return s
        raise ValueError("these hidden states did not come back from the pipeline")

    def _settle(self, slot: int) -> None:
        """Before a slot's buffers are filled again: its earlier sends are done, its step is received (a
        step dropped by a failure is still sent back by the stages)."""
        for w in self.sends[slot]:
            self._wait(w, None)
        self.sends[slot].clear()
        pending = self.recvs[slot]
        if pending is not None:
            self._wait(pending.recv, self.last)
            self.recvs[slot] = None

    # ---- allocator counters -----------------------------------------------------------------------
    def memory(self) -> list[dict[str, int]]:
        """Every stage's allocator counters (`MEMORY_KEYS`), by rank, rank 0's own first: each stage
        answers once it has run the messages posted before the question, so between steps they are
        its counters after the steps launched so far. Asked for, not sent with the steps."""
        header = torch.zeros(HEADER + INLINE, dtype=torch.int64)
        header[0] = OP_MEMORY
        with self.lock:
            for s in range(1, self.plan.world):
                self._send(header, s, self.ctrl, TAG_CTRL)
        out = [memory_counters(torch.device(self.plan.device))]
        for s in range(1, self.plan.world):
            buf = torch.zeros(len(MEMORY_KEYS), dtype=torch.int64)
            self._recv(buf, s, self.ctrl, TAG_MEMORY)
            out.append(buf)
        return [dict(zip(MEMORY_KEYS, c.tolist())) for c in out]

    # ---- messages ---------------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dst: int, group, tag: int) -> None:
        try:
            dist.send(t, dst, group=group, tag=tag)
        except Exception as e:  # the peer's connection is gone: no later step can run
            self._lost(dst, e)

    def _recv(self, t: torch.Tensor, src: int, group, tag: int) -> None:
        try:
            dist.recv(t, src, group=group, tag=tag)
        except Exception as e:
            self._lost(src, e)

    def _isend(self, t: torch.Tensor, dst: int, group, tag: int):
        try:
            return dist.isend(t, dst, group=group, tag=tag)
        except Exception as e:
            self._lost(dst, e)

    def _irecv(self, t: torch.Tensor, src: int, group, tag: int):
        try:
            return dist.irecv(t, src, group=group, tag=tag)
        except Exception as e:
            self._lost(src, e)

    def _wait(self, work, rank: int | None) -> None:
        try:
            work.wait()
        except Exception as e:
            self._lost(rank, e)

    def _lost(self, rank: int | None, e: Exception) -> None:
        if self.stopping:
            return
        time.sleep(0.5)  # let the watcher name the stage that died first, with its exit status
        dead = next(((r, p) for r, p in self.children if p.poll() is not None), None)
        if dead is not None:
            self._fail_stage(*dead)
        who = f"pipeline stage {rank}" if rank is not None else "a pipeline stage"
        fatal(f"{who} is unreachable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
              "stopping the server")

    def _fail_stage(self, rank: int, p: subprocess.Popen) -> None:
        self.stopping = True
        for _, q in self.children:
            if q.poll() is None:
                q.kill()
        fatal(f"pipeline stage {rank} (layers {self.plan.ranges[rank][0]}-{self.plan.ranges[rank][1] - 1}, "
              f"pid {p.pid}) {exit_reason(p.returncode)}; stopping the server")

    def _watch(self) -> None:
        while not self.stopping:
            for r, p in self.children:
                if p.poll() is not None and not self.stopping:
                    self._fail_stage(r, p)
            time.sleep(0.1)

    # ---- shutdown ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Tell every stage to exit and wait for the ones this process started."""
        if self.stopping:
            return
        self.stopping = True
        # Nothing outlives the pipeline: the exit hook would hold this link, and through its runner the
        # engine's K/V pool, for the life of the process.
        atexit.unregister(self.stop)
        if self.runner is None:  # stopped before the stages were given their sizes: nothing to wind down
            for _, p in self.children:
                if p.poll() is None:
                    p.kill()
                p.wait()
            self._leave_group()
            return
        header = torch.zeros(HEADER + INLINE, dtype=torch.int64)
        header[0] = OP_STOP
        try:
            with self.lock:
                for s in range(self.slots):
                    for w in self.sends[s]:
                        w.wait()
                    self.sends[s].clear()
            for s in range(1, self.plan.world):
                dist.send(header, s, group=self.ctrl, tag=TAG_CTRL)
        except Exception:
            pass
        for _, p in self.children:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self._leave_group()
        self.runner = None

    @staticmethod
    def _leave_group() -> None:
        """So that this process may join another pipeline (an engine started again, a test)."""
        try:
            dist.destroy_process_group()
        except Exception:
            pass


@dataclass(frozen=True)
class StagePlacement:
    """What rank 0's memory plan gives a stage before it loads: the MoE layers whose routed experts stay
    in RAM and, on CUDA, its plan's K/V tokens, budget, scratch and allocator cap (bytes; -1: none)."""

    host_layers: tuple[int, ...] = ()
    kv_tokens: int = -1
    budget: int = -1
    scratch: int = -1
    cap: int = -1

    def words(self, num_layers: int) -> torch.Tensor:
        out = torch.zeros(self.size(num_layers), dtype=torch.int64)
        out[:PLACE] = torch.tensor([self.kv_tokens, self.budget, self.scratch, self.cap, len(self.host_layers), 0])
        out[PLACE : PLACE + len(self.host_layers)] = torch.tensor(self.host_layers, dtype=torch.int64)
        return out

    @classmethod
    def size(cls, num_layers: int) -> int:
        return PLACE + num_layers

    @classmethod
    def of(cls, words: torch.Tensor) -> "StagePlacement":
        w = words.tolist()
        return cls(tuple(w[PLACE : PLACE + w[4]]), *w[:4])

