"""What the GPU's kernels reach reading pinned host memory in place over PCIe (`--host-expert-decode pcie`,
`--kv-tier-decode pcie`), beside the copy engine:

- copy: a pinned 1 GiB buffer copied to the GPU (`copy_`, non-blocking), the copy engine's rate;
- experts: one decode row through an 80B-A3B layer's routed experts (512 experts of IQ3_S, 10 chosen,
  `strata.kernels.quant.moe_decode_q`), the stacks in the GPU's memory and in a pinned host region
  (`StreamStack`, as the experts kept in RAM are), fresh experts for each repeat;
- experts, configurations: the same row from pinned memory with K steps of one super-block (the
  default) and of two (`pcie_configs`, longer runs of each row's bytes), each with more or fewer rows a
  program than the default's, each checked against the default's sum;
- attention: one decode row of the 8B shape (32 query heads, 8 KV heads of 128) over 114,688 tokens of an
  int8 pool, and of the 80B-A3B's full-attention layers (16 query heads, 2 KV heads of 256) over 98,304
  (128K less a 32K window), whole-context with the keys split as the KV tier's PCIe way splits them
  (`tiered.pcie_splits`), the pool in the GPU's memory and pinned in the host's; from pinned memory also
  at fixed counts of keys a split.

Prints milliseconds and bytes read per second for each. Needs CUDA.

    python benchmarks/kernels/pcie_reads.py
"""

from __future__ import annotations

import dataclasses
import time

import torch

from strata.attention import tiered
from strata.kernels import attention as k_attn
from strata.kernels.quant import random_blocks
from strata.kernels.quant.moe_decode_q import decode_config, moe_decode_q_triton, pcie_configs
from strata.kernels.quant.moe_q import QExpertStack
from strata.kvcache.pool import make_pool
from strata.models.host_experts import StreamStack


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for r in range(repeats + 1):  # the first builds and warms
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(r)
        torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    return min(times)


def copy_rate() -> None:
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    s = best_of(lambda r: dev.copy_(host, non_blocking=True))
    print(f"copy engine, 1 GiB pinned -> GPU: {s * 1e3:.1f} ms, {host.numel() / s / 1e9:.1f} GB/s", flush=True)


def experts(e: int = 512, hidden: int = 2048, inter: int = 512, k: int = 10) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    raw13 = random_blocks("IQ3_S", e * 2 * inter, hidden, g, "cuda").view(e, 2 * inter, -1)
    raw2 = random_blocks("IQ3_S", e * hidden, inter, g, "cuda").view(e, hidden, -1)
    on_gpu = QExpertStack.from_raw("IQ3_S", raw13), QExpertStack.from_raw("IQ3_S", raw2)
    pinned = StreamStack.of_quant(*(QExpertStack.from_raw("IQ3_S", r.cpu()) for r in (raw13, raw2)))
    in_ram = pinned.stacks(pinned.region)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, k, device="cuda"), dim=-1)
    order = torch.randperm(e, device="cuda")
    chosen = k * pinned.nbytes / e
    for name, stacks in (("GPU memory", on_gpu), ("pinned host memory", in_ram)):
        s = best_of(lambda r: moe_decode_q_triton(x, order[r * k:(r + 1) * k].view(1, k), w, *stacks))
        print(f"80B-A3B layer, one row, IQ3_S experts in {name}: {s * 1e3:.3f} ms, {chosen / s / 1e9:.1f} GB/s of "
              f"chosen experts ({chosen / 1e6:.1f} MB)", flush=True)
    default = decode_config("IQ3_S", hidden, inter)
    ref = moe_decode_q_triton(x, order[:k].view(1, k), w, *in_ram).float()
    longer = pcie_configs("IQ3_S", hidden, inter)[-1]
    for base in (default, longer):
        for rows_i, rows_h, warps in ((base.gate_up_block_i, base.down_block_h, base.gate_up_warps), (4, 2, 4),
                                      (16, 8, 4), (32, 16, 4), (16, 8, 8)):
            sweep_one(dataclasses.replace(base, gate_up_block_i=rows_i, down_block_h=rows_h, gate_up_warps=warps,
                                          down_warps=warps), x, w, order, k, in_ram, ref, chosen)


def sweep_one(cfg, x, w, order, k, in_ram, ref, chosen) -> None:
    """One tile configuration over the pinned stacks: its time and its sum's distance from `ref`."""
    rows_i, rows_h, warps, k_i = cfg.gate_up_block_i, cfg.down_block_h, cfg.gate_up_warps, cfg.gate_up_block_k
    ids = order[:k].view(1, k)
    try:
        got = moe_decode_q_triton(x, ids, w, *in_ram, config=cfg).float()
        s = best_of(lambda r: moe_decode_q_triton(x, order[r * k:(r + 1) * k].view(1, k), w, *in_ram, config=cfg))
    except Exception as err:  # noqa: BLE001 - a tile shape this device cannot build: the next one
        print(f"  K steps of {k_i}, gate_up {rows_i} rows, down {rows_h} rows, {warps} warps: {type(err).__name__}: "
              f"{str(err)[:120]}", flush=True)
        return
    err = float((got - ref).norm() / ref.norm())
    print(f"  pinned, K steps of {k_i}, gate_up {rows_i} rows, down {rows_h} rows, {warps} warps: {s * 1e3:.3f} ms, "
          f"{chosen / s / 1e9:.1f} GB/s (relative difference from the default's sum {err:.1e})", flush=True)


def attention(name: str, tokens: int, hq: int, hkv: int, d: int, bs: int = 16) -> None:
    blocks = tokens // bs
    table = torch.randperm(blocks, dtype=torch.int32, device="cuda")[None]
    meta = [torch.tensor([v], dtype=torch.int32, device="cuda") for v in (0, 1, tokens)]
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(1, hq, device="cuda")
    splits = tiered.pcie_splits(tokens, hkv, torch.cuda.get_device_properties(0).multi_processor_count)
    ws = k_attn.SplitWorkspace(1, hq, d, splits, "cuda")
    for where, device, pin in (("GPU memory", "cuda", False), ("pinned host memory", "cpu", True)):
        pool = make_pool("int8", 1, blocks, bs, hkv, d, device, torch.bfloat16, pin=pin)
        for t in (pool.k, pool.v):
            t.random_(-100, 100)
        pool.k_scale.fill_(0.01)
        pool.v_scale.fill_(0.01)
        s = best_of(lambda r: k_attn.paged_attention_triton(
            q, pool.k[0], pool.v[0], table, *meta, out, block_size=bs, max_q_len=1, scale=d ** -0.5,
            k_scale=pool.k_scale[0], v_scale=pool.v_scale[0], lse=lse, whole_context=True, num_splits=splits,
            workspace=ws))
        read = tokens * hkv * (2 * d + 8)
        print(f"{name} layer, one row over {tokens} int8 tokens in {where} ({splits} splits): {s * 1e3:.2f} ms, "
              f"{read / s / 1e9:.1f} GB/s", flush=True)
        if pin:  # the split count the PCIe way takes against fixed keys a split
            for keys in (256, 512, 1024, 4096):
                n = max(1, -(-tokens // keys))
                more = k_attn.SplitWorkspace(1, hq, d, n, "cuda")
                s = best_of(lambda r: k_attn.paged_attention_triton(
                    q, pool.k[0], pool.v[0], table, *meta, out, block_size=bs, max_q_len=1, scale=d ** -0.5,
                    k_scale=pool.k_scale[0], v_scale=pool.v_scale[0], lse=lse, whole_context=True, num_splits=n,
                    workspace=more))
                print(f"  pinned, {n} splits: {s * 1e3:.2f} ms, {read / s / 1e9:.1f} GB/s", flush=True)
        del pool


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    copy_rate()
    experts()
    attention("8B", 114_688, 32, 8, 128)
    attention("80B-A3B", 98_304, 16, 2, 256)


if __name__ == "__main__":
    main()
