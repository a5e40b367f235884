"""A pipeline stage other than rank 0: its decoder layers, its KV pool, and the loop that runs them.

Start-up: the stage tells rank 0 its GPU budget, gets its placement back (rank 0's memory plan of this
stage's layers: the MoE layers whose routed experts stay in RAM, its allocator cap), loads only its
layers (`load_model(layers=...)`; the last stage also the MTP head with the embedding and the head it
uses), tells rank 0 how many K/V tokens it can hold (or why it refuses to run: `--batch-invariant` over
layers it does not cover), and waits for the geometry: the pool's block count (the block allocator is
rank 0's, so every stage's pool has the same blocks; the smallest any stage can hold), the step buffers'
sizes and, for a hybrid model, the state pool's slots.

Then, per message from rank 0, in the order rank 0 posted them: a step — its metadata (a hybrid's state
spans and the states to restore after rejected drafts among them), the hidden states from the previous
stage, its layers, the hidden states to the next stage (the last stage applies the final norm and sends
them to rank 0); on the last stage, a drafting message (`strata.dist.draft`); or a question for its
allocator counters, answered at once (`Link.memory`). A step's output leaves from its ring slot's
buffer without waiting for the next stage (`isend`), so the stage goes on with the next step at once; it
waits for a slot's earlier send only when it fills the slot again.

With CUDA graphs (`--cuda-graph`, the Triton backend, no linear-attention states, no experts in RAM on
this stage), decode-sized steps (every sequence at most 1 + --spec rows) replay this stage's layers
from a graph captured per bucket of sequences at start-up, as rank 0's runner does for the whole model.
"""

from __future__ import annotations

import gc
import logging

import torch
import torch.distributed as dist

from strata.attention import make_attention
from strata.config import EngineConfig, graph_buckets
from strata.dist.draft import DraftServer
from strata.dist.link import (GEOMETRY, HEADER, INLINE, OP_DRAFT, OP_MEMORY, OP_STOP, REASON, REFUSED, SPAN,
                              TAG_BACK, TAG_CTRL, TAG_DATA, TAG_MEMORY, TAG_START, StagePlacement, Trace,
                              memory_counters, meta_words, split_hidden)
from strata.dist.plan import StagePlan
from strata.env import torch_allocator_configured
from strata.kernels import choices as kernel_choices
from strata.kvcache.pool import kv_bytes_per_token, make_pool
from strata.loaders import default_model_path, load_model, read_model
from strata.memory_plan import GiB
from strata.models.invariance import check_batch_invariant
from strata.runner.host_offload import set_up_host_experts
from strata.runner.model_runner import CPU_ONE_THREAD_ROWS
from strata.speculative.drafter import MTPDrafter

log = logging.getLogger("strata")

UNLIMITED = 1 << 62  # a stage's K/V capacity when nothing but rank 0 bounds it


def free_share(device: torch.device, utilization: float, sharing: int) -> int:
    """The bytes this process may still take of the card: its free memory x `utilization`; where
    `sharing` stages share the card, its share of the whole card less what this process holds (the
    others' allocations come and go while each one sizes its pool, so free memory would count them
    twice or not at all). An engine built before in this process (a test's or a benchmark's previous
    one) may linger in a reference cycle, or as blocks in torch's cache: both are released first."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    if sharing <= 1:
        return int(free * utilization)
    return max(min(int(total * utilization) // sharing - torch.cuda.memory_reserved(device), free), 0)


def budget_bytes(cfg: EngineConfig, device: torch.device, sharing: int = 1) -> int:
    """The stage's GPU budget: --gpu-memory, else its share of the card's memory (`free_share`)."""
    if device.type != "cuda":
        return 0
    if cfg.gpu_memory is not None:
        return int(cfg.gpu_memory * GiB)
    return free_share(device, cfg.gpu_memory_utilization, sharing)


def _cap(device: torch.device, cap: int) -> None:
    """torch's caching allocator may hold at most `cap` bytes of this card (as rank 0's under --gpu-memory)."""
    if not torch_allocator_configured():
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device.index or 0)


def kv_capacity(cfg: EngineConfig, place: StagePlacement, device: torch.device, per_token: int, reserved: int,
                sharing: int = 1) -> int:
    """The K/V tokens this stage can hold beside its weights (rank 0 takes the smallest of all stages'):
    within its plan under --gpu-memory, else of the card's free memory less its plan's scratch;
    `reserved`: bytes still to come (the last stage's drafter buffers)."""
    if cfg.kv_size or device.type != "cuda" or not per_token:
        return UNLIMITED
    gc.collect()
    torch.cuda.empty_cache()
    if place.kv_tokens >= 0:
        left = place.budget - place.scratch - torch.cuda.memory_reserved(device) - reserved
        return max(min(place.kv_tokens, left // per_token), 0)
    return max(free_share(device, cfg.gpu_memory_utilization, sharing) - reserved - max(place.scratch, 0), 0) // per_token


@torch.inference_mode()
def run_stage(cfg: EngineConfig, plan: StagePlan, ctrl, data) -> None:
    """Serve steps until rank 0 says stop. `ctrl`: the metadata's gloo group; `data`: the hidden states'."""
    cfg = cfg.resolved()
    kernel_choices.set_choices(cfg.kernel_choices())
    device, dtype = torch.device(plan.device), cfg.torch_dtype
    first, last = plan.layers
    is_last = plan.rank == plan.world - 1
    path = cfg.model or default_model_path()
    ckpt, mc = read_model(path)
    dist.send(torch.tensor([budget_bytes(cfg, device, plan.sharing)], dtype=torch.int64), 0, group=ctrl, tag=TAG_START)
    words = torch.zeros(StagePlacement.size(mc.num_hidden_layers), dtype=torch.int64)
    dist.recv(words, 0, group=ctrl, tag=TAG_START)
    place = StagePlacement.of(words)
    if device.type == "cuda" and place.cap >= 0:
        _cap(device, place.cap)
    loaded = load_model(path, device=device, dtype=dtype, progress=False, keep_quantized=bool(cfg.keep_quantized),
                        quantize=cfg.quantize, host_moe_layers=place.host_layers, host_experts=cfg.host_experts,
                        checkpoint=ckpt, layers=(first, last))
    model = loaded.model
    set_up_host_experts(model, mc, cfg, device)
    try:  # rank 0 checks its own layers only
        check_batch_invariant(cfg, mc, device, model)
    except ValueError as e:
        _refuse(str(e), ctrl)
    model.set_batch_invariant(cfg.batch_invariant)
    layers = list(model.model.layers[first:last])
    per_token = kv_bytes_per_token(model.num_attention_layers, mc.num_key_value_heads, mc.head_dim, cfg.kv, dtype)
    drafts_here = is_last and bool(cfg.spec) and bool(model.mtp_layers)
    # The drafter's prompt hidden states, allocated once the geometry comes (rank 0's plan counted them).
    reserved = (cfg.parallel * min(cfg.ctx, mc.max_position_embeddings) * mc.hidden_size * dtype.itemsize
                if drafts_here and not MTPDrafter.split_mode() else 0)
    capacity = kv_capacity(cfg, place, device, per_token, reserved, plan.sharing)
    dist.send(torch.tensor([capacity], dtype=torch.int64), 0, group=ctrl, tag=TAG_START)

    geometry = torch.zeros(GEOMETRY, dtype=torch.int64)
    dist.recv(geometry, 0, group=ctrl, tag=TAG_CTRL)
    (num_blocks, max_rows, max_seqs, max_len, split_rows, max_blocks, block_size, num_states, verify_rows, spec,
     split_mtp, slots) = geometry.tolist()
    pool = make_pool(cfg.kv, model.num_attention_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim,
                     device, dtype)
    attn = make_attention(pool, mc, max_seqs=max_seqs, max_rows=max_rows, max_split_rows=split_rows, device=device,
                          dtype=dtype, max_context=max_len, batch_invariant=cfg.batch_invariant)
    # A hybrid's linear layers: their states, in the slots rank 0's runner indexes (its own layers' only).
    states = attn.states = (model.new_states(num_states, device, dtype, verify_rows=verify_rows)
                            if num_states else None)
    hidden = mc.hidden_size
    server = None
    if is_last and spec:
        if not model.mtp_layers:
            raise ValueError(f"{path}: --spec needs a model with an MTP head; this one has none")
        drafter = MTPDrafter(model, pool, max_drafts=spec, min_p=cfg.spec_min_p, batch_mtp=cfg.batch_mtp,
                             adaptive=cfg.spec_adaptive, max_model_len=max_len, max_seqs=max_seqs - 1,
                             chunk_size=cfg.chunk_size, device=device, dtype=dtype, seed_of=lambda req: req.seed,
                             max_num_batched_tokens=cfg.max_num_batched_tokens, cuda_graph=cfg.cuda_graph,
                             split=bool(split_mtp))  # rank 0's prompt mode, whatever this machine's environment
        server = DraftServer(drafter, ctrl, max_seqs - 1, spec, max_blocks, max_len)
    loop = StageLoop(plan, model, layers, attn, states, ctrl, data, device, dtype, hidden, max_rows, max_seqs,
                     max_blocks, num_states, is_last, server, slots)
    if server is not None:
        server.drafter.capture_graphs()
    if (device.type == "cuda" and cfg.cuda_graph and attn.meta is not None and states is None
            and not place.host_layers):
        loop.capture_graphs(graph_buckets(max_seqs - 1), 1 + cfg.spec, max_len)
    log.info("pipeline stage %d: layers %d-%d on %s, %d blocks of K/V%s", plan.rank, first, last - 1, device,
             num_blocks, ", the MTP head" if server is not None else "")
    dist.send(torch.ones(1, dtype=torch.int64), 0, group=ctrl, tag=TAG_CTRL)
    loop.run()


def _refuse(reason: str, ctrl) -> None:
    """Send rank 0 `reason` instead of this stage's K/V capacity, and wait to be stopped: rank 0 stops the
    stages it started; where it started none, its exit ends the receive."""
    text = reason.encode()[:REASON]
    words = torch.zeros(REASON, dtype=torch.uint8)
    words[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    dist.send(torch.tensor([REFUSED], dtype=torch.int64), 0, group=ctrl, tag=TAG_START)
    dist.send(words, 0, group=ctrl, tag=TAG_START)
    try:
        dist.recv(torch.zeros(GEOMETRY, dtype=torch.int64), 0, group=ctrl, tag=TAG_CTRL)
    except Exception:
        pass
    raise SystemExit(1)


class StageLoop:
    """A stage's step buffers and the loop over rank 0's messages."""

    def __init__(self, plan: StagePlan, model, layers, attn, states, ctrl, data, device: torch.device,
                 dtype: torch.dtype, hidden: int, max_rows: int, max_seqs: int, max_blocks: int, num_states: int,
                 is_last: bool, server: DraftServer | None, slots: int):
        self.plan, self.model, self.layers, self.attn, self.states = plan, model, layers, attn, states
        self.ctrl, self.data, self.device, self.dtype, self.hidden = ctrl, data, device, dtype, hidden
        self.is_last, self.server = is_last, server
        self.trace = Trace(plan.rank)
        self.ctrl_buf = torch.zeros(meta_words(max_rows, max_seqs, max_blocks, num_states), dtype=torch.int64)
        self.d_pos = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.d_slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.d_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        # Stages sharing a GPU talk over gloo (host tensors): hidden states through pinned host buffers.
        self.via_host = device.type == "cuda" and dist.get_backend(data) == "gloo"
        where = dict(device="cpu", pin_memory=True) if self.via_host else dict(device=device)
        self.h_in = torch.zeros(2 * max_rows * hidden, dtype=dtype, **where)
        self.h_dev = torch.zeros(2 * max_rows * hidden, dtype=dtype, device=device) if self.via_host else self.h_in
        # What a step sends on, per ring slot: hidden state and residual stream, or (the last stage) the
        # final hidden states, which its drafter reads until the slot is filled again.
        width = (1 if is_last else 2) * max_rows * hidden
        self.out_dev = [torch.zeros(width, dtype=dtype, device=device) for _ in range(slots)]
        self.out = ([torch.zeros(width, dtype=dtype, **where) for _ in range(slots)] if self.via_host
                    else self.out_dev)
        self.final = [t[: max_rows * hidden].view(max_rows, hidden) for t in self.out_dev]
        self.sends: list = [None] * slots
        self.prev, self.nxt = plan.rank - 1, (plan.rank + 1) % plan.world
        self.cpu_threads = torch.get_num_threads() if device.type == "cpu" else None
        self.graphs: dict[int, "_StageGraph"] = {}
        self.rows_per_seq = 0

    def run(self) -> None:
        buf = self.ctrl_buf
        while True:
            dist.recv(buf[: HEADER + INLINE], 0, group=self.ctrl, tag=TAG_CTRL)
            op = int(buf[0])
            if op == OP_STOP:
                for w in self.sends:
                    if w is not None:
                        w.wait()
                return
            if op == OP_DRAFT:
                self.server.serve(buf[: HEADER + INLINE], self.final)
                continue
            if op == OP_MEMORY:
                dist.send(memory_counters(self.device), 0, group=self.ctrl, tag=TAG_MEMORY)
                continue
            self.step()

    def step(self) -> None:
        buf, hidden = self.ctrl_buf, self.hidden
        _, n, r, width, words, k, undo, slot, step = buf[:9].tolist()
        if words > HEADER + INLINE:
            dist.recv(buf[HEADER + INLINE : words], 0, group=self.ctrl, tag=TAG_CTRL)
        meta = buf[HEADER:]
        msg_in, xi, ri = split_hidden(self.h_in, n, hidden)
        dist.recv(msg_in, self.prev, group=self.data, tag=TAG_DATA + slot)
        self.trace("in", step, slot)
        if self.via_host:
            dev, xi, ri = split_hidden(self.h_dev, n, hidden)
            dev.copy_(msg_in)
        if self.cpu_threads is not None:  # the thread count rank 0's runner computes such a step with
            threads = 1 if n <= CPU_ONE_THREAD_ROWS else self.cpu_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        starts = meta[2 * n : 2 * n + r].tolist()
        lens = meta[2 * n + r : 2 * n + 2 * r].tolist()
        tables = meta[2 * n + 2 * r : 2 * n + 2 * r + r * width].view(r, width)
        if self.states is not None:
            o = 2 * n + 2 * r + r * width
            spans = meta[o : o + SPAN * k].view(k, SPAN).tolist()
            o += SPAN * k
            for state, row in meta[o : o + 2 * undo].view(undo, 2).tolist():
                self.states.restore(state, row)
            self.states.set_spans([(a, b, c, bool(fresh), bool(keep)) for a, b, c, fresh, keep in spans])
        g = self._graph_for(r, lens)
        if g is not None:
            out = g.replay(self, meta, n, r, starts, lens, tables, xi, ri)
            self.trace("replay", step, slot)
        else:
            self.d_pos[:n].copy_(meta[:n])
            self.d_slots[:n].copy_(meta[n : 2 * n])
            self.d_tables[:r, :width].copy_(tables)
            self.attn.prepare(self.d_slots[:n], starts, lens, self.d_tables[:r])
            out = self._layers(xi, ri, self.d_pos[:n])
        if self.sends[slot] is not None:
            self.sends[slot].wait()
        dst = self.out_dev[slot]
        if self.is_last:
            dst[: n * hidden].view(n, hidden).copy_(out)
            size, tag = n * hidden, TAG_BACK + slot
        else:
            x, res = out
            _, xo, ro = split_hidden(dst, n, hidden)
            xo.copy_(x)
            ro.copy_(res)
            size, tag = 2 * n * hidden, TAG_DATA + slot
        if self.via_host:
            self.out[slot][:size].copy_(dst[:size])
        self.sends[slot] = dist.isend(self.out[slot][:size], self.nxt, group=self.data, tag=tag)
        self.trace("out", step, slot)

    def _layers(self, x: torch.Tensor, res: torch.Tensor, pos: torch.Tensor):
        """This stage's layers over the step's rows; the last stage's final norm too."""
        rope = self.model.rope(pos, self.dtype)
        for layer in self.layers:
            x, res = layer.forward_fused(x, res, rope, self.attn)
        if self.is_last:
            return self.model.model.norm.add_forward(x, res)[0]
        return x, res

    # ---- CUDA graphs ------------------------------------------------------------------------------
    def _graph_for(self, r: int, lens: list[int]) -> "_StageGraph | None":
        if not self.graphs or max(lens) > self.rows_per_seq:
            return None
        for b in sorted(self.graphs):
            if b >= r:
                return self.graphs[b]
        return None

    def capture_graphs(self, buckets: list[int], rows_per_seq: int, max_len: int) -> None:
        """This stage's layers for decode-sized steps, one graph per bucket of sequences (largest first,
        one memory pool), each sequence up to `rows_per_seq` rows: the buckets rank 0's runner uses."""
        self.rows_per_seq = q = rows_per_seq
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        rows_max = buckets[0] * q
        self.g_meta = torch.zeros(3, buckets[0] + 1, dtype=torch.int32, pin_memory=True)
        self.g_copied = torch.cuda.Event()  # the layout's copy out of g_meta: done before g_meta is refilled
        self.g_x = torch.zeros(rows_max, self.hidden, dtype=self.dtype, device=self.device)
        self.g_res = torch.zeros(rows_max, self.hidden, dtype=self.dtype, device=self.device)
        for b in buckets:
            rows = b * q
            # Every sequence reads q tokens at the start of the padding block (slot 0): capture writes
            # nothing that matters.
            self.d_pos[:rows].copy_(torch.arange(q, device=self.device).repeat(b))
            self.d_slots[:rows].zero_()
            self.d_tables[:b].zero_()
            self.attn.meta[0, :b].copy_(torch.arange(0, rows, q, dtype=torch.int32, device=self.device))
            self.attn.meta[1, :b] = q
            self.attn.meta[2, :b] = q
            self.attn.set_layout(self.d_slots[:rows], self.d_tables[:b], b, q, max_len)
            body = lambda rows=rows: self._layers(self.g_x[:rows], self.g_res[:rows], self.d_pos[:rows])
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # kernels compile and library handles are made outside the capture
                    body()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = body()
            self.graphs[b] = _StageGraph(graph, b, rows, out, max_len)
        torch.cuda.synchronize(self.device)
        log.info("pipeline stage %d: captured %d CUDA graphs of its layers (up to %d sequences x %d rows)",
                 self.plan.rank, len(buckets), buckets[0], q)


class _StageGraph:
    def __init__(self, graph, seqs: int, rows: int, out, max_len: int):
        self.graph, self.seqs, self.rows, self.out, self.max_len = graph, seqs, rows, out, max_len

    def replay(self, loop: StageLoop, meta: torch.Tensor, n: int, r: int, starts: list[int], lens: list[int],
               tables: torch.Tensor, x: torch.Tensor, res: torch.Tensor):
        """The step padded to the bucket: padding rows read token state 0 at position 0 and write their K/V
        into slot 0 (the padding block); padding sequences have no rows and no context."""
        g_rows, g_seqs = self.rows, self.seqs
        loop.d_pos[:n].copy_(meta[:n], non_blocking=True)
        loop.d_pos[n:g_rows].zero_()
        loop.d_slots[:n].copy_(meta[n : 2 * n], non_blocking=True)
        loop.d_slots[n:g_rows].zero_()
        loop.d_tables[:r, : tables.shape[1]].copy_(tables, non_blocking=True)
        loop.g_copied.synchronize()
        m = loop.g_meta.numpy()
        q_start = 0
        for i in range(r):
            m[0, i], m[1, i], m[2, i] = q_start, lens[i], starts[i] + lens[i]
            q_start += lens[i]
        m[:, r:g_seqs] = 0
        m[0, r:g_seqs] = n
        loop.attn.meta[:, :g_seqs].copy_(loop.g_meta[:, :g_seqs], non_blocking=True)
        loop.g_copied.record()
        loop.g_x[:n].copy_(x)
        loop.g_res[:n].copy_(res)
        loop.g_x[n:g_rows].zero_()
        loop.g_res[n:g_rows].zero_()
        self.graph.replay()
        if loop.is_last:
            return self.out[:n]
        return self.out[0][:n], self.out[1][:n]
