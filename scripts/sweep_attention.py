"""Times the paged attention kernel on the GPU, for choosing the constants in
`strata/kernels/attention.py` (a development tool; the engine never autotunes).

    python scripts/sweep_attention.py                  # prefill tile rows, then the decode split table
    python scripts/sweep_attention.py --only decode    # one section (prefill | decode | decode-configs
                                                       # | decode-wide-head: Qwen3-Next's heads of 256
                                                       # | decode-short: tiles at 576 / 4K / 32K keys)
    python scripts/sweep_attention.py --json out.json  # also write every decode measurement

Decode: one query per sequence (Qwen3-8B heads, 32 / 8 x 128, pool block size 16) at contexts 576, 4K and
32K, batches 1, 8 and 32, with the grid a CUDA graph captured for a 40960-token model gets
(`choose_num_splits` over max_model_len, capped at the runner's MAX_SPLITS), for each MIN_SPLIT_KEYS,
over bf16 and int8 caches (int8 key tiles of 64 and 128). Each figure is device time per launch of a
graph of launches over distinct copies of the caches (enough copies, up to 128, that they do not fit in
L2, as a step's 36 layers do not), so it includes the launch gaps of a replayed step and no host overhead.
GB/s counts K and V values only (int8: one byte each; the scales add 1/32 more).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from strata.kernels import attention as A
from strata.attention.triton_backend import MAX_SPLITS

HQ, HKV, D, BS = 32, 8, 128, 16
MAX_MODEL_LEN = 40960
DECODE_CONTEXTS = (576, 4096, 32768)
DECODE_BATCHES = (1, 8, 32)
MIN_SPLIT_KEYS_CHOICES = (64, 128, 256, 512, 1024)
DECODE_KINDS = (("bf16", False, None), ("int8/64", True, 64), ("int8/128", True, 128))  # name, int8, key tile
MAX_COPIES = 128  # launches per graph at most
COLD_BYTES = 256 << 20  # copies of the caches per graph until this many K/V bytes: well past the 50 MB L2


def _setup(seqs, int8: bool, copies: int = 1, heads=(HQ, HKV, D)):
    """q / out / lengths for `seqs` [(q_len, ctx)], and `copies` independent block tables (each over
    its own blocks of one pool) so that a graph of launches can read different memory each time;
    `heads`: (query heads, KV heads, head size)."""
    hq, hkv, d = heads
    blocks = [math.ceil(c / BS) for _, c in seqs]
    num_blocks = 1 + copies * sum(blocks)
    ids = torch.randperm(num_blocks - 1, device="cuda").int() + 1
    tables = torch.zeros(copies, len(seqs), max(blocks), dtype=torch.int32, device="cuda")
    off = 0
    for c in range(copies):
        for r, nb in enumerate(blocks):
            tables[c, r, :nb] = ids[off:off + nb]
            off += nb
    shape = (num_blocks * BS, hkv, d)
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
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0] + [q for q, _ in seqs][:-1], device="cuda").cumsum(0).int()
    lens = torch.tensor([q for q, _ in seqs], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
    return dict(q=q, k=k, v=v, ks=ks, vs=vs, tables=tables[0], all_tables=tables, starts=starts, lens=lens,
                ctx=ctx, out=torch.empty_like(q), max_q=max(q for q, _ in seqs))


def _call(case, splits, ws, tables=None):
    A.paged_attention_triton(case["q"], case["k"], case["v"], case["tables"] if tables is None else tables,
                             case["starts"], case["lens"], case["ctx"], case["out"], block_size=BS,
                             max_q_len=case["max_q"], scale=case["q"].shape[-1] ** -0.5, k_scale=case["ks"],
                             v_scale=case["vs"],
                             num_splits=splits, workspace=ws)


def _time(case, splits, ws, iters=10) -> float:
    """Milliseconds per eager call (long calls only: includes host launch overhead)."""
    _call(case, splits, ws)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        _call(case, splits, ws)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def _graph_us(case, splits, ws, replays=10) -> float:
    """Microseconds of device time per launch: one launch per table copy captured in a CUDA graph."""
    _call(case, splits, ws)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for tables in case["all_tables"]:
            _call(case, splits, ws, tables)
    graph.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(replays):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    us = s.elapsed_time(e) * 1e3 / (replays * case["all_tables"].shape[0])
    del graph
    return us


def sweep_prefill(only: str = "") -> None:
    prefill = {name: _setup(seqs, int8) for name, seqs, int8 in (
        ("32K", [(32768, 32768)], False), ("8K@32K", [(8192, 32768)], False), ("8K@32K int8", [(8192, 32768)], True))}
    base = (A.KV_TILE, A.PREFILL_KV_TILE, A.PREFILL_CONFIG, A.PREFILL_CONFIG_INT8)
    print("prefill: kv_tile block_m warps stages -> TFLOP/s per case")
    configs = list(itertools.product((64, 128), (128,), (4, 8), (2, 3, 4))) + [(64, 64, 4, 3), (128, 64, 4, 3)]
    # Two warp groups sharing each K/V tile (FlashAttention-3's 2 x 128 query rows per CTA).
    configs += [(64, 256, 8, 2), (64, 256, 8, 3), (128, 256, 8, 2)]
    if only:
        configs = [tuple(int(v) for v in c.split(",")) for c in only.split(";")]
    for tile, bm, w, st in configs:
        A.KV_TILE = A.PREFILL_KV_TILE = tile  # int8 prefill reads KV_TILE
        A.PREFILL_CONFIG = A.PREFILL_CONFIG_INT8 = A.TileConfig(bm, w, st)
        A.select_config.cache_clear()
        res = []
        for name, c in prefill.items():
            try:
                ms = _time(c, 1, None, iters=3)
                res.append(f"{name} {A.attention_flops(c['max_q'], int(c['ctx'][0]), HQ, D) / ms / 1e9:6.0f}")
            except Exception as e:  # a config that does not fit shared memory: report and go on
                res.append(f"{name} fail({type(e).__name__})")
        print(f"  {tile:3d} {bm:3d} {w} {st}: " + " | ".join(res), flush=True)
    A.KV_TILE, A.PREFILL_KV_TILE, A.PREFILL_CONFIG, A.PREFILL_CONFIG_INT8 = base
    A.select_config.cache_clear()


def sweep_decode(num_sms: int) -> list[dict]:
    """The split table: every context x batch x MIN_SPLIT_KEYS x cache kind, graph-timed."""
    base = (A.MIN_SPLIT_KEYS, A.KV_TILE_INT8)
    rows = []
    for ctx, batch in itertools.product(DECODE_CONTEXTS, DECODE_BATCHES):
        seqs = [(1, ctx)] * batch
        kv_values = batch * ctx * HKV * D * 2  # K and V elements
        cases = {}
        for int8 in (False, True):
            copies = min(MAX_COPIES, math.ceil(COLD_BYTES / (kv_values * (1 if int8 else 2))))
            cases[int8] = _setup(seqs, int8, copies)
        ws = A.SplitWorkspace(batch, HQ, D, MAX_SPLITS, "cuda")
        for min_keys in MIN_SPLIT_KEYS_CHOICES:
            A.MIN_SPLIT_KEYS = min_keys
            splits = A.choose_num_splits(batch, 1, HKV, MAX_MODEL_LEN, num_sms, MAX_SPLITS)
            active = min(splits, math.ceil(ctx / min_keys))
            row = dict(ctx=ctx, batch=batch, min_split_keys=min_keys, grid_splits=splits, active_splits=active)
            for name, int8, tile in DECODE_KINDS:
                if tile:
                    A.KV_TILE_INT8 = tile
                A.select_config.cache_clear()
                us = _graph_us(cases[int8], splits, ws)
                row[name] = dict(us=us, gbs=kv_values * (1 if int8 else 2) / us / 1e3)
            rows.append(row)
        del cases, ws
        torch.cuda.empty_cache()
    A.MIN_SPLIT_KEYS, A.KV_TILE_INT8 = base
    A.select_config.cache_clear()
    return rows


def print_decode(rows: list[dict]) -> None:
    head = f"{'ctx':>6} {'batch':>5} {'grid':>4} |" + "".join(f"{m:>13}" for m in MIN_SPLIT_KEYS_CHOICES)
    by = {(r["ctx"], r["batch"], r["min_split_keys"]): r for r in rows}
    cases = list(itertools.product(DECODE_CONTEXTS, DECODE_BATCHES))
    for name, _, _ in DECODE_KINDS:
        print(f"decode {name}: us per launch / GB/s of K+V per MIN_SPLIT_KEYS; grid = splits in the grid")
        print(head)
        for ctx, batch in cases:
            cells = [by[ctx, batch, m][name] for m in MIN_SPLIT_KEYS_CHOICES]
            grid = by[ctx, batch, MIN_SPLIT_KEYS_CHOICES[0]]["grid_splits"]
            print(f"{ctx:>6} {batch:>5} {grid:>4} |" + "".join(f"{c['us']:7.1f}/{c['gbs']:<5.0f}" for c in cells))
    print("int8 speed-up over bf16 (bf16 us / int8 us), key tile 64 | 128, per MIN_SPLIT_KEYS")
    print(head)
    for ctx, batch in cases:
        cells = [by[ctx, batch, m] for m in MIN_SPLIT_KEYS_CHOICES]
        ratios = [(c["bf16"]["us"] / c["int8/64"]["us"], c["bf16"]["us"] / c["int8/128"]["us"]) for c in cells]
        print(f"{ctx:>6} {batch:>5} {cells[0]['grid_splits']:>4} |" + "".join(f"{r64:6.2f}|{r128:<6.2f}"
                                                                          for r64, r128 in ratios))
    print("each MIN_SPLIT_KEYS against the best one of each case: geometric mean | worst of us / best us")
    print(f"{'':>8} |" + "".join(f"{m:>13}" for m in MIN_SPLIT_KEYS_CHOICES))
    for name, _, _ in DECODE_KINDS:
        cells = []
        for m in MIN_SPLIT_KEYS_CHOICES:
            slow = [by[c, b, m][name]["us"] / min(by[c, b, k][name]["us"] for k in MIN_SPLIT_KEYS_CHOICES)
                    for c, b in cases]
            cells.append(f"{math.exp(sum(map(math.log, slow)) / len(slow)):6.3f}|{max(slow):<6.2f}")
        print(f"{name:>8} |" + "".join(cells))


def sweep_decode_configs(num_sms: int) -> None:
    """The decode tile shape (warps, stages, key tile) at 32K with the current MIN_SPLIT_KEYS."""
    decode = {name: _setup(seqs, int8) for name, seqs, int8 in (
        ("b1@32K", [(1, 32768)], False), ("b8@32K", [(1, 32768)] * 8, False),
        ("b1@32K int8", [(1, 32768)], True), ("b8@32K int8", [(1, 32768)] * 8, True))}
    ws = A.SplitWorkspace(64, HQ, D, 64, "cuda")
    base = (A.KV_TILE_DECODE, A.KV_TILE_INT8, A.DECODE_CONFIG, A.DECODE_CONFIG_INT8)
    print("decode configs: kv_tile warps stages waves -> GB/s of K+V per case (eager calls)")
    for tile, w, st, waves in list(itertools.product((64, 128), (2, 4), (3, 4), (2, 4))):
        A.KV_TILE_DECODE, A.KV_TILE_INT8 = tile, tile
        A.DECODE_CONFIG = A.DECODE_CONFIG_INT8 = A.TileConfig(16, w, st)
        A.select_config.cache_clear()
        res = []
        for name, c in decode.items():
            b = c["lens"].shape[0]
            splits = A.choose_num_splits(b, 1, HKV, 32768, num_sms, 64, waves)
            elt = 1 if c["ks"] is not None else 2
            try:
                ms = _time(c, splits, ws)
                res.append(f"{name} {b * 32768 * HKV * D * 2 * elt / ms / 1e6:6.0f}")
            except Exception as e:
                res.append(f"{name} fail({type(e).__name__})")
        print(f"  {tile:3d} {w} {st} {waves}: " + " | ".join(res), flush=True)
    A.KV_TILE_DECODE, A.KV_TILE_INT8, A.DECODE_CONFIG, A.DECODE_CONFIG_INT8 = base
    A.select_config.cache_clear()


SHORT_TILES = ((64, 2, 3), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 4, 3))  # key tile, warps, stages


def sweep_decode_short(num_sms: int, contexts=(576, 4096, 32768), tiles=None) -> None:
    """bf16 decode tiles (key tile, warps, stages) x MIN_SPLIT_KEYS at 576, 4K and 32K keys (or
    `contexts`), batches 1 and 8, graph-timed over cold copies: whether short contexts want other tiles
    than the 32K sweep's. MIN_SPLIT_KEYS 256 gives the split rule shipped before FEW_SPLITS."""
    base = (A.KV_TILE_DECODE, A.DECODE_CONFIG, A.MIN_SPLIT_KEYS)
    print("decode (bf16): us per launch for (key tile, warps, stages) x MIN_SPLIT_KEYS "
          + " ".join(str(m) for m in (64, 128, 256)))
    for ctx, batch in itertools.product(contexts, (1, 8)):
        seqs = [(1, ctx)] * batch
        case = _setup(seqs, False, min(MAX_COPIES, math.ceil(COLD_BYTES / (batch * ctx * HKV * D * 4))))
        ws = A.SplitWorkspace(batch, HQ, D, MAX_SPLITS, "cuda")
        splits = A.choose_num_splits(batch, 1, HKV, MAX_MODEL_LEN, num_sms, MAX_SPLITS)
        for tile, warps, stages in tiles or SHORT_TILES:
            A.KV_TILE_DECODE, A.DECODE_CONFIG = tile, A.TileConfig(16, warps, stages)
            cells = []
            for min_keys in (64, 128, 256):
                A.MIN_SPLIT_KEYS = min_keys
                A.select_config.cache_clear()
                try:
                    cells.append(f"{_graph_us(case, splits, ws):8.2f}")
                except Exception as exc:  # a tile that does not fit: reported, the others still run
                    cells.append(f"fail({type(exc).__name__})")
            print(f"  ctx {ctx:5d} batch {batch}: {tile:3d} {warps} {stages} |" + " ".join(cells), flush=True)
        del case, ws
        torch.cuda.empty_cache()
    A.KV_TILE_DECODE, A.DECODE_CONFIG, A.MIN_SPLIT_KEYS = base
    A.select_config.cache_clear()


WIDE_HEADS = (16, 2, 256)  # Qwen3-Next's gated attention
WIDE_HEAD_CONFIGS = ((2, 64), (4, 32), (4, 64), (8, 32))  # (warps, key tile); (2, 64): the 128-head tiles


def sweep_decode_wide_head(num_sms: int) -> None:
    """Decode tiles for heads of 256 (DECODE_CONFIG_WIDE_HEAD), graph-timed: per context and batch,
    each (warps, key tile) at each MIN_SPLIT_KEYS, µs per launch over cold copies of the caches."""
    hq, hkv, d = WIDE_HEADS
    base = (A.DECODE_CONFIG_WIDE_HEAD, A.MIN_SPLIT_KEYS)
    print(f"decode, heads {hq}/{hkv} x {d}, bf16: us per launch for (warps, key tile) x MIN_SPLIT_KEYS")
    print(f"{'ctx':>6} {'batch':>5} | " + " ".join(f"w{w}/kv{t}:" + ",".join(str(m) for m in (64, 128, 256))
                                                   for w, t in WIDE_HEAD_CONFIGS))
    for ctx, batch in itertools.product(DECODE_CONTEXTS, (1, 8)):
        seqs = [(1, ctx)] * batch
        kv_bytes = batch * ctx * hkv * d * 2 * 2
        case = _setup(seqs, False, min(MAX_COPIES, math.ceil(COLD_BYTES / kv_bytes)), WIDE_HEADS)
        ws = A.SplitWorkspace(batch, hq, d, MAX_SPLITS, "cuda")
        cells = []
        for w, tile in WIDE_HEAD_CONFIGS:
            A.DECODE_CONFIG_WIDE_HEAD = A.TileConfig(16, w, 2, tile)
            for min_keys in (64, 128, 256):
                A.MIN_SPLIT_KEYS = min_keys
                A.select_config.cache_clear()
                splits = A.choose_num_splits(batch, 1, hkv, MAX_MODEL_LEN, num_sms, MAX_SPLITS)
                cells.append(_graph_us(case, splits, ws))
        print(f"{ctx:>6} {batch:>5} | " + " ".join(f"{u:6.1f}" for u in cells), flush=True)
        del case, ws
        torch.cuda.empty_cache()
    A.DECODE_CONFIG_WIDE_HEAD, A.MIN_SPLIT_KEYS = base
    A.select_config.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("prefill", "decode", "decode-configs", "decode-wide-head", "decode-short"))
    parser.add_argument("--prefill-configs", default="",
                        help="only these prefill configs, 'tile,block_m,warps,stages;...' (default: all)")
    parser.add_argument("--json", help="write the decode measurements here")
    parser.add_argument("--short-contexts", default="576,4096,32768", help="decode-short: contexts")
    parser.add_argument("--short-tiles", default="", help="decode-short: 'keys,warps,stages;...' (default: all)")
    args = parser.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.only in (None, "prefill"):
        sweep_prefill(args.prefill_configs)
    if args.only in (None, "decode"):
        rows = sweep_decode(num_sms)
        print_decode(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    if args.only == "decode-wide-head":
        sweep_decode_wide_head(num_sms)
    if args.only == "decode-configs":
        sweep_decode_configs(num_sms)
    if args.only == "decode-short":
        sweep_decode_short(num_sms, tuple(int(c) for c in args.short_contexts.split(",")),
                           [tuple(int(v) for v in t.split(",")) for t in args.short_tiles.split(";") if t])


if __name__ == "__main__":
    main()
