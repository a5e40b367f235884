"""Rank 0's side of the pipeline.

Rank 0 runs the engine unchanged: its model holds the embedding, its own decoder layers, the final norm,
the head and the MTP head; where the next stage's layers begin sits a `StageBoundary`. When a step's
forward reaches it, the boundary sends the step's metadata (positions, K/V slots, per sequence the first
position and row count, block tables; for a hybrid model the linear-attention spans and the states to
restore after rejected drafts) once to every other stage over the control group, the hidden
state and residual stream to stage 1, and receives them back from the last stage, whose layers end the
stack. Every buffer is allocated when the link is attached; a step only copies into them.

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

import torch
import torch.distributed as dist
from torch import nn

from strata.dist.plan import StagePlan

log = logging.getLogger("strata")

OP_STEP, OP_STOP = 1, 2
HEADER = 8  # int64 words: op, rows, sequences, table width, metadata words, state spans, state restores
# A step's control message: the header and up to INLINE words of metadata, in one send (a decode step's
# fit); a larger step's remainder follows in a second. Each message costs a round of scheduling latency.
INLINE = 1024
# int64 words: blocks, rows, sequences, context, split rows, blocks per table, block size, linear-attention
# states (0: no hybrid), their verification rows
GEOMETRY = 10
SPAN = 5  # a state span's words: first row, rows, state index, fresh, keep (`StatePool.set_spans`)
TAG_CTRL, TAG_DATA = 1, 2


def fatal(message: str) -> None:
    """End the process at once: a pipeline with a stage gone cannot compute any step."""
    print(f"strata: error: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


def meta_words(max_rows: int, max_seqs: int, max_blocks: int, num_states: int = 0) -> int:
    """The control buffer's size: header, positions, slots, starts, lens, block tables, state spans (at
    most one per state) and restores (at most one per state: a later one replaces an earlier)."""
    return HEADER + max(INLINE, 2 * max_rows + max_seqs * (2 + max_blocks) + num_states * (SPAN + 2))


def split_hidden(buf: torch.Tensor, n: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the message, hidden states [n, H], residual stream [n, H]): both in one contiguous send."""
    msg = buf[: 2 * n * hidden]
    return msg, msg[: n * hidden].view(n, hidden), msg[n * hidden :].view(n, hidden)


def exit_reason(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class StageBoundary(nn.Module):
    """Where rank 0's model hands its hidden states to the other stages and takes them back."""

    held_elsewhere = True

    def __init__(self, link: "Link", layer_idx: int):
        super().__init__()
        self.link = link
        self.layer_idx = layer_idx

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope, attn):
        return self.link.round_trip(x, residual)


class Link:
    def __init__(self, plan: StagePlan, ctrl, data, children: list[tuple[int, subprocess.Popen]]):
        """`ctrl`: the gloo group of the metadata (host tensors); `data`: the hidden states' group (NCCL
        on GPUs, the same gloo group on the CPU). `children`: (rank, process) of the stages this process
        started."""
        self.plan, self.ctrl, self.data, self.children = plan, ctrl, data, children
        self.runner = None
        self.seqs = 0  # sequences of the step being launched (recorded from the attention layout)
        self.steps = 0
        self.stopping = False
        self.watch = None
        if children:
            self.watch = threading.Thread(target=self._watch, name="strata-stage-watch", daemon=True)
            self.watch.start()
        atexit.register(self.stop)

    # ---- start-up ---------------------------------------------------------------------------------
    def engine_config(self, cfg):
        """Rank 0's engine config: its stage's device; no CUDA graphs (the boundary is host code)."""
        import dataclasses

        return dataclasses.replace(cfg, device=self.plan.device, cuda_graph=False)

    def install(self, model: nn.Module) -> None:
        """Put the boundary where rank 0's layers end (the loader left placeholders from there on)."""
        k = self.plan.layers[1]
        model.model.layers[k] = StageBoundary(self, k)
        log.info("pipeline: %d stages (%s)", self.plan.world, self.plan.describe())

    def attach(self, runner, num_blocks: int, max_model_len: int, max_split_rows: int) -> None:
        """Give every stage the pool's and the step buffers' sizes, wait until each has built them, and
        allocate rank 0's own buffers."""
        self.runner = runner
        self.block_size = runner.pool.block_size
        max_rows, max_seqs, max_blocks = runner.h_ids.shape[0], runner.h_tables.shape[0], runner.h_tables.shape[1]
        self.states = states = runner.attn.states
        num_states, verify_rows = (states.num_states, states.verify_rows) if states is not None else (0, 0)
        geometry = torch.tensor([num_blocks, max_rows, max_seqs, max_model_len, max_split_rows, max_blocks,
                                 self.block_size, num_states, verify_rows, 0], dtype=torch.int64)
        for r in range(1, self.plan.world):
            self._send(geometry, r, self.ctrl, TAG_CTRL)
        ready = torch.zeros(1, dtype=torch.int64)
        for r in range(1, self.plan.world):
            self._recv(ready, r, self.ctrl, TAG_CTRL)
        self.hidden = hidden = runner.model.config.hidden_size
        dtype, device = runner.model.model.embed_tokens.weight.dtype, runner.device
        # Stages sharing a GPU talk over gloo, which sends host tensors: their hidden states go through
        # pinned host buffers (a device twin holds what comes back).
        self.via_host = device.type == "cuda" and dist.get_backend(self.data) == "gloo"
        where = dict(device="cpu", pin_memory=True) if self.via_host else dict(device=device)
        self.out, self.back = (torch.zeros(2 * max_rows * hidden, dtype=dtype, **where) for _ in range(2))
        self.back_dev = torch.zeros(2 * max_rows * hidden, dtype=dtype, device=device) if self.via_host else None
        self.meta = torch.zeros(meta_words(max_rows, max_seqs, max_blocks, num_states), dtype=torch.int64)
        self.np_meta = self.meta.numpy()
        # Per state, the verification row to go back to before the next step (-1: none).
        self.restores = torch.full((num_states,), -1, dtype=torch.int64).numpy()
        self._tap(runner.attn)
        log.info("pipeline: every stage ready (%d blocks of K/V each)", num_blocks)

    def _tap(self, attn) -> None:
        """Record each step's sequence count where the runner sets the attention layout (the boundary
        reads the rest of the layout from the runner's host buffers)."""
        link = self
        prepare, set_layout = attn.prepare, getattr(attn, "set_layout", None)

        def tapped_prepare(slots, starts, lens, tables):
            link.seqs = len(starts)
            return prepare(slots, starts, lens, tables)

        attn.prepare = tapped_prepare
        if set_layout is not None:
            def tapped_set_layout(slots, tables, num_seqs, *args, **kwargs):
                link.seqs = num_seqs
                return set_layout(slots, tables, num_seqs, *args, **kwargs)

            attn.set_layout = tapped_set_layout
        if self.states is not None:
            restore = self.states.restore

            def tapped_restore(state: int, row: int) -> None:
                # The runner restores after the step's forward: the stages do so before their next one,
                # which is the first to read the state again.
                link.restores[state] = row
                restore(state, row)

            self.states.restore = tapped_restore

    # ---- a step -----------------------------------------------------------------------------------
    def round_trip(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rn, n, r = self.runner, x.shape[0], self.seqs
        lens, ctx = rn.np_meta[1, :r], rn.np_meta[2, :r]
        width = -(-int(ctx.max()) // self.block_size)
        m, o = self.np_meta, HEADER
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
        if self.states is not None:
            spans = self.states.spans
            k = len(spans)
            if k:
                m[o : o + SPAN * k].reshape(k, SPAN)[:] = spans
            o += SPAN * k
            (todo,) = (self.restores >= 0).nonzero()
            undo = len(todo)
            m[o : o + 2 * undo : 2] = todo
            m[o + 1 : o + 2 * undo : 2] = self.restores[todo]
            self.restores[todo] = -1
            o += 2 * undo
        m[:7] = (OP_STEP, n, r, width, o, k, undo)
        for s in range(1, self.plan.world):
            self._send(self.meta[: HEADER + INLINE], s, self.ctrl, TAG_CTRL)
            if o > HEADER + INLINE:
                self._send(self.meta[HEADER + INLINE : o], s, self.ctrl, TAG_CTRL)
        out, xo, ro = split_hidden(self.out, n, self.hidden)
        xo.copy_(x)
        ro.copy_(residual)
        self._send(out, 1, self.data, TAG_DATA)
        back, xi, ri = split_hidden(self.back, n, self.hidden)
        self._recv(back, self.plan.world - 1, self.data, TAG_DATA)
        if self.back_dev is not None:
            dev, xi, ri = split_hidden(self.back_dev, n, self.hidden)
            dev.copy_(back)
        self.steps += 1
        return xi, ri

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

    def _lost(self, rank: int, e: Exception) -> None:
        if self.stopping:
            return
        time.sleep(0.5)  # let the watcher name the stage that died first, with its exit status
        dead = next(((r, p) for r, p in self.children if p.poll() is not None), None)
        if dead is not None:
            self._fail_stage(*dead)
        fatal(f"pipeline stage {rank} is unreachable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
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
        if self.runner is None:  # stopped before the stages were given their sizes: nothing to wind down
            for _, p in self.children:
                if p.poll() is None:
                    p.kill()
                p.wait()
            return
        header = torch.zeros(HEADER + INLINE, dtype=torch.int64)
        header[0] = OP_STOP
        for s in range(1, self.plan.world):
            try:
                dist.send(header, s, group=self.ctrl, tag=TAG_CTRL)
            except Exception:
                pass
        for _, p in self.children:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        try:
            dist.destroy_process_group()
        except Exception:
            pass
