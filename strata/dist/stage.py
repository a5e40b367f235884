"""A pipeline stage other than rank 0: its decoder layers, its KV pool, and the loop that runs them.

The stage loads only its layers (`load_model(layers=...)`), waits for rank 0's geometry (the pool's
block count and the step buffers' sizes: the block allocator is rank 0's, so every stage's pool has
the same blocks; for a hybrid model, the state pool's slots), builds its pools and attention backend,
and then, per step: the header and metadata from rank 0 (a hybrid's state spans and the states to
restore after rejected drafts among them), the hidden states from the previous stage, its layers, the hidden states to the next stage
(rank 0 after the last). Everything it sends or receives lands in buffers made before the first step.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from strata.attention import make_attention
from strata.config import EngineConfig
from strata.dist.link import GEOMETRY, HEADER, INLINE, OP_STOP, SPAN, TAG_CTRL, TAG_DATA, meta_words, split_hidden
from strata.dist.plan import StagePlan
from strata.kernels import choices as kernel_choices
from strata.kvcache.pool import make_pool
from strata.loaders import default_model_path, load_model
from strata.runner.model_runner import CPU_ONE_THREAD_ROWS

log = logging.getLogger("strata")


@torch.inference_mode()
def run_stage(cfg: EngineConfig, plan: StagePlan, ctrl, data) -> None:
    """Serve steps until rank 0 says stop. `ctrl`: the metadata's gloo group; `data`: the hidden states'."""
    cfg = cfg.resolved()
    kernel_choices.set_choices(cfg.kernel_choices())
    device, dtype = torch.device(plan.device), cfg.torch_dtype
    first, last = plan.layers
    loaded = load_model(cfg.model or default_model_path(), device=device, dtype=dtype, progress=False,
                        keep_quantized=bool(cfg.keep_quantized), quantize=cfg.quantize, layers=(first, last))
    model, mc = loaded.model, loaded.config
    model.set_batch_invariant(cfg.batch_invariant)
    layers = list(model.model.layers[first:last])
    geometry = torch.zeros(GEOMETRY, dtype=torch.int64)
    dist.recv(geometry, 0, group=ctrl, tag=TAG_CTRL)
    num_blocks, max_rows, max_seqs, max_len, split_rows, max_blocks, block_size, num_states, verify_rows = \
        geometry.tolist()[:9]
    pool = make_pool(cfg.kv, model.num_attention_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim, device, dtype)
    attn = make_attention(pool, mc, max_seqs=max_seqs, max_rows=max_rows, max_split_rows=split_rows, device=device,
                          dtype=dtype, max_context=max_len, batch_invariant=cfg.batch_invariant)
    # A hybrid's linear layers: their states, in the slots rank 0's runner indexes (its own layers' only).
    states = attn.states = (model.new_states(num_states, device, dtype, verify_rows=verify_rows)
                            if num_states else None)
    ctrl_buf = torch.zeros(meta_words(max_rows, max_seqs, max_blocks, num_states), dtype=torch.int64)
    meta = ctrl_buf[HEADER:]
    d_pos = torch.zeros(max_rows, dtype=torch.long, device=device)
    d_slots = torch.zeros(max_rows, dtype=torch.long, device=device)
    d_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
    hidden = mc.hidden_size
    # Stages sharing a GPU talk over gloo (host tensors): hidden states through pinned host buffers.
    via_host = device.type == "cuda" and dist.get_backend(data) == "gloo"
    where = dict(device="cpu", pin_memory=True) if via_host else dict(device=device)
    h_in, h_out = (torch.zeros(2 * max_rows * hidden, dtype=dtype, **where) for _ in range(2))
    h_dev = torch.zeros(2 * max_rows * hidden, dtype=dtype, device=device) if via_host else None
    prev, nxt = plan.rank - 1, (plan.rank + 1) % plan.world
    cpu_threads = torch.get_num_threads() if device.type == "cpu" else None
    log.info("pipeline stage %d: layers %d-%d on %s, %d blocks of K/V", plan.rank, first, last - 1, device, num_blocks)
    dist.send(torch.ones(1, dtype=torch.int64), 0, group=ctrl, tag=TAG_CTRL)
    while True:
        dist.recv(ctrl_buf[: HEADER + INLINE], 0, group=ctrl, tag=TAG_CTRL)
        op, n, r, width, words, k, undo = ctrl_buf[:7].tolist()
        if op == OP_STOP:
            return
        if words > HEADER + INLINE:
            dist.recv(ctrl_buf[HEADER + INLINE : words], 0, group=ctrl, tag=TAG_CTRL)
        msg_in, xi, ri = split_hidden(h_in, n, hidden)
        msg_out, xo, ro = split_hidden(h_out, n, hidden)
        dist.recv(msg_in, prev, group=data, tag=TAG_DATA)
        if h_dev is not None:
            dev, xi, ri = split_hidden(h_dev, n, hidden)
            dev.copy_(msg_in)
        if cpu_threads is not None:  # the thread count rank 0's runner computes such a step with
            threads = 1 if n <= CPU_ONE_THREAD_ROWS else cpu_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        d_pos[:n].copy_(meta[:n])
        d_slots[:n].copy_(meta[n : 2 * n])
        starts = meta[2 * n : 2 * n + r].tolist()
        lens = meta[2 * n + r : 2 * n + 2 * r].tolist()
        d_tables[:r, :width].copy_(meta[2 * n + 2 * r : 2 * n + 2 * r + r * width].view(r, width))
        attn.prepare(d_slots[:n], starts, lens, d_tables[:r])
        if states is not None:
            o = 2 * n + 2 * r + r * width
            spans = meta[o : o + SPAN * k].view(k, SPAN).tolist()
            o += SPAN * k
            for state, row in meta[o : o + 2 * undo].view(undo, 2).tolist():
                states.restore(state, row)
            states.set_spans([(a, b, c, bool(fresh), bool(keep)) for a, b, c, fresh, keep in spans])
        rope = model.rope(d_pos[:n], dtype)
        x, res = xi, ri
        for layer in layers:
            x, res = layer.forward_fused(x, res, rope, attn)
        xo.copy_(x)
        ro.copy_(res)
        dist.send(msg_out, nxt, group=data, tag=TAG_DATA)
