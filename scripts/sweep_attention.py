"""Times the paged attention kernel under several tile configurations on the GPU, for choosing the
constants in `strata/kernels/attention.py` (a development tool; the engine never autotunes).

    python scripts/sweep_attention.py
"""

from __future__ import annotations

import itertools
import math

import torch

from strata.kernels import attention as A

HQ, HKV, D, BS = 32, 8, 128, 16


def _setup(seqs, int8: bool):
    blocks = [math.ceil(c / BS) for _, c in seqs]
    num_blocks = 1 + sum(blocks)
    ids = torch.randperm(num_blocks - 1, device="cuda").int() + 1
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32, device="cuda")
    off = 0
    for r, nb in enumerate(blocks):
        tables[r, :nb] = ids[off:off + nb]
        off += nb
    shape = (num_blocks * BS, HKV, D)
    if int8:
        k = torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8)
        v = torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8)
        ks = torch.rand(shape[:2], device="cuda") * 0.02
        vs = torch.rand(shape[:2], device="cuda") * 0.02
    else:
        k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        ks = vs = None
    n = sum(q for q, _ in seqs)
    q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0] + [q for q, _ in seqs][:-1], device="cuda").cumsum(0).int()
    lens = torch.tensor([q for q, _ in seqs], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
    return dict(q=q, k=k, v=v, ks=ks, vs=vs, tables=tables, starts=starts, lens=lens, ctx=ctx,
                out=torch.empty_like(q), max_q=max(q for q, _ in seqs))


def _time(case, splits, ws, iters=10) -> float:
    def fn():
        A.paged_attention_triton(case["q"], case["k"], case["v"], case["tables"], case["starts"], case["lens"],
                                 case["ctx"], case["out"], block_size=BS, max_q_len=case["max_q"], scale=D ** -0.5,
                                 k_scale=case["ks"], v_scale=case["vs"], num_splits=splits, workspace=ws)
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def main() -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = A.SplitWorkspace(64, HQ, D, 64, "cuda")
    prefill = {name: _setup(seqs, int8) for name, seqs, int8 in (
        ("32K", [(32768, 32768)], False), ("8K@32K", [(8192, 32768)], False), ("8K@32K int8", [(8192, 32768)], True))}
    decode = {name: _setup(seqs, int8) for name, seqs, int8 in (
        ("b1@32K", [(1, 32768)], False), ("b8@32K", [(1, 32768)] * 8, False),
        ("b1@32K int8", [(1, 32768)], True), ("b8@32K int8", [(1, 32768)] * 8, True))}
    base = (A.KV_TILE, A.PREFILL_CONFIG, A.DECODE_CONFIG)
    print("prefill: kv_tile block_m warps stages -> TFLOP/s per case")
    configs = list(itertools.product((64, 128), (128,), (4, 8), (2, 3, 4))) + [(64, 64, 4, 3), (128, 64, 4, 3)]
    for tile, bm, w, st in configs:
        A.KV_TILE, A.PREFILL_CONFIG = tile, A.TileConfig(bm, w, st)
        A.select_config.cache_clear()
        res = []
        for name, c in prefill.items():
            try:
                ms = _time(c, 1, None, iters=3)
                res.append(f"{name} {A.attention_flops(c['max_q'], int(c['ctx'][0]), HQ, D) / ms / 1e9:6.0f}")
            except Exception as e:  # a config that does not fit shared memory: report and go on
                res.append(f"{name} fail({type(e).__name__})")
        print(f"  {tile:3d} {bm:3d} {w} {st}: " + " | ".join(res), flush=True)
    A.KV_TILE, A.PREFILL_CONFIG = base[0], base[1]
    print("decode: kv_tile warps stages -> GB/s of K/V per case")
    configs = list(itertools.product((64, 128), (4,), (2, 3, 4))) + [(64, 2, 3), (64, 8, 3)]
    for tile, w, st in configs:
        A.KV_TILE, A.DECODE_CONFIG = tile, A.TileConfig(16, w, st)
        A.select_config.cache_clear()
        res = []
        for name, c in decode.items():
            b = c["lens"].shape[0]
            splits = A.choose_num_splits(b, 1, HKV, 32768, num_sms, 64)
            elt = 1 if c["ks"] is not None else 2
            try:
                ms = _time(c, splits, ws)
                res.append(f"{name} {b * 32768 * HKV * D * 2 * elt / ms / 1e6:6.0f}")
            except Exception as e:
                res.append(f"{name} fail({type(e).__name__})")
        print(f"  {tile:3d} {w} {st}: " + " | ".join(res), flush=True)
    A.KV_TILE, A.PREFILL_CONFIG, A.DECODE_CONFIG = base
    A.select_config.cache_clear()


if __name__ == "__main__":
    main()
