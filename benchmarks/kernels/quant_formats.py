"""The GGUF formats' own kernels (`strata.kernels.quant.q8_0`, `q4_k`, `q6_k`, `iq3_s`, their dp4a
GEMVs and the Q8_0 stream-K GEMM). Needs a CUDA device.

    python benchmarks/kernels/quant_formats.py                         # every format: `matmul` vs bf16
    python benchmarks/kernels/quant_formats.py --formats Q8_0,IQ3_S --ms 1,8,4096
    python benchmarks/kernels/quant_formats.py --sweep Q8_0            # dequantizing GEMV configurations
    python benchmarks/kernels/quant_formats.py --sweep Q4_K
    python benchmarks/kernels/quant_formats.py --dp4a Q6_K             # dequantizing GEMV vs dp4a configs
    python benchmarks/kernels/quant_formats.py --streamk               # Q8_0 stream-K vs the tiled GEMM

The table: per shape and M, the format's `matmul` (whichever kernel it picks for M) against bf16
torch.matmul of the dequantized weight, both cycling over weight copies past L2 so every call reads
HBM: µs, GB/s of the weight bytes each reads, TFLOP/s, and the relative Frobenius error against the
fp32 product of the dequantized weight.
"""

from __future__ import annotations

import argparse
import statistics
from types import ModuleType

import torch

from strata.kernels.quant import format_module, random_blocks
from timing import copies_past_l2, parse_ints, parse_shapes, require_cuda, time_us

FORMATS = ("Q8_0", "Q4_K", "Q6_K", "IQ3_S")
SHAPES = [("8B qkv", 6144, 4096), ("8B o_proj", 4096, 4096), ("8B gate_up", 24576, 4096),
          ("8B down", 4096, 12288)]
LM_HEAD_SHAPE = (151936, 4096)  # Qwen3's LM head (Q6_K in a Q4_K_M file)


def plane_bytes(planes: dict[str, torch.Tensor]) -> int:
    """Bytes of the planes a kernel reads (not IQ3_S's GEMV workspace)."""
    return sum(t.numel() * t.element_size() for name, t in planes.items() if name != "workspace")


def weight_copies(mod: ModuleType, n: int, k: int) -> list[dict[str, torch.Tensor]]:
    """Enough repacked random weights (≥ 4, ≥ 3x the L2 in all) that cycling through them reads HBM."""
    first = mod.repack(torch.from_numpy(mod.random_raw(n, k, 0)).cuda())
    count = copies_past_l2(plane_bytes(first))
    return [first] + [mod.repack(torch.from_numpy(mod.random_raw(n, k, seed)).cuda()) for seed in range(1, count)]


def _clones(planes: dict[str, torch.Tensor], n: int, k: int) -> list[dict[str, torch.Tensor]]:
    """`planes` and clones of it, ≥ 300 MB of int8-sized weights in all (past L2)."""
    return [planes] + [{key: t.clone() for key, t in planes.items()} for _ in range(max(1, (300 << 20) // (n * k)))]


def bench_format(mod: ModuleType, ms=(1, 4096), shapes=SHAPES, runs: int = 50) -> list[dict]:
    """Per shape and M: the format's µs, GB/s of its planes and TFLOP/s, the same for bf16 (its bytes),
    and the relative error against the fp32 product of the dequantized weight. Row keys are prefixed
    by the format's short name (`q4k_us`, `q6k_gbs`, ...)."""
    key = mod.GGML_TYPE.lower().replace("_", "")
    label = mod.GGML_TYPE.lower()
    rows = []
    print(f"{'shape':>12} {'N x K':>12} {'M':>5} | {label + ' us':>9} {'GB/s':>6} {'TFLOP/s':>7} | "
          f"{'bf16 us':>9} {'GB/s':>6} {'TFLOP/s':>7} | rel err", flush=True)
    for name, n, k in shapes:
        planes = weight_copies(mod, n, k)
        dense = [mod.dequantize(p, n, k).to(torch.bfloat16) for p in planes]
        qbytes = plane_bytes(planes[0])
        ws = None
        if hasattr(mod, "gemv_workspace_numel"):  # IQ3_S keeps its GEMV workspace in the planes
            ws = torch.zeros(max(1, mod.gemv_workspace_numel(n, k)), dtype=torch.int32, device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            t_q = time_us([lambda p=p: mod.matmul(x, p, n, k, out, workspace=ws) for p in planes], runs)
            t_d = time_us([lambda w=w: torch.matmul(x, w.t()) for w in dense], runs)
            ref = torch.matmul(x.float(), dense[0].float().t())
            err = ((mod.matmul(x, planes[0], n, k, workspace=ws).float() - ref).norm() / ref.norm()).item()
            flops = 2 * m * n * k
            row = {"shape": name, "n": n, "k": k, "m": m, f"{key}_us": t_q, "bf16_us": t_d,
                   f"{key}_gbs": qbytes / t_q / 1e3, "bf16_gbs": n * k * 2 / t_d / 1e3,
                   f"{key}_tflops": flops / t_q / 1e6, "bf16_tflops": flops / t_d / 1e6, "rel_err": err}
            rows.append(row)
            print(f"{name:>12} {f'{n}x{k}':>12} {m:>5} | {t_q:9.2f} {row[key + '_gbs']:6.0f} "
                  f"{row[key + '_tflops']:7.1f} | {t_d:9.2f} {row['bf16_gbs']:6.0f} {row['bf16_tflops']:7.1f} | "
                  f"{err:.1e}", flush=True)
        del planes, dense
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------- GEMV sweeps


def sweep_q8_0_gemv(shapes=SHAPES, ms=(1, 8)) -> None:
    """Times Q8_0's dequantizing GEMV configurations per shape (mean µs over `ms`, weight copies past
    L2) and prints the five best beside the current one (`q8_0.GEMV_CONFIGS`)."""
    from strata.kernels.quant import q8_0

    for name, n, k in shapes:
        planes = q8_0.repack(torch.from_numpy(q8_0.random_raw(n, k, seed=n + k)).cuda())
        copies = [planes] + [{key: t.clone() for key, t in planes.items()} for _ in range(max(1, (150 << 20) // (n * k)))]
        candidates = {q8_0.gemv_config(n, k)}
        for block_n in (32, 64, 128):
            for block_k in (128, 256):
                for split in (1, 2, 3, 4, 6, 8):
                    for warps, stages in ((4, 4), (8, 3)):
                        cfg = q8_0.Q8Config(q8_0.GEMV_MAX_ROWS, block_n, block_k, warps, stages, split_k=split)
                        steps = k // block_k
                        programs = -(-n // block_n) * split
                        if k % block_k or split > max(1, steps // 2) or not 100 <= programs <= 1600:
                            continue
                        candidates.add(cfg)
        results = []
        for cfg in candidates:
            ws = torch.zeros(max(1, q8_0.gemv_workspace_numel(n, k, cfg)), dtype=torch.int32, device="cuda")
            times = []
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                times.append(time_us([lambda p=p: q8_0.matmul_triton(x, p, n, k, out, config=cfg, workspace=ws)
                                      for p in copies], runs=30))
            results.append((statistics.mean(times), times, cfg))
        results.sort(key=lambda r: r[0])
        qbytes = n * k * q8_0.BLOCK_BYTES // q8_0.BLOCK_VALUES
        current = next(r for r in results if r[2] == q8_0.gemv_config(n, k))
        print(f"{name} {n}x{k}: current {current[0]:8.2f} us {qbytes / current[0] / 1e3:6.0f} GB/s {current[2]}")
        for mean_t, times, cfg in results[:5]:
            print(f"   {mean_t:8.2f} us {qbytes / mean_t / 1e3:6.0f} GB/s  per M {[round(t, 2) for t in times]}  {cfg}",
                  flush=True)
        del copies, planes
        torch.cuda.empty_cache()


def sweep_q4_k_gemv(shapes=SHAPES, ms=(1, 8)) -> None:
    """Times Q4_K's dequantizing GEMV configurations per shape (mean µs over `ms`) and prints the five best."""
    from strata.kernels.quant import q4_k

    for name, n, k in shapes:
        planes = weight_copies(q4_k, n, k)
        results = []
        for block_n in (64, 128):
            for block_k in (128, 256):
                for split in (1, 2, 3, 4, 6, 8, 12):
                    for stages in (3, 4, 6):
                        cfg = q4_k.GemvConfig(block_n, block_k, split, stages)
                        if split > k // block_k // 2 or not 100 <= cfg.programs(n) <= 1600:
                            continue
                        ws = torch.zeros(max(1, q4_k.gemv_workspace_numel(n, k, cfg)), dtype=torch.int32,
                                         device="cuda")
                        times = []
                        for m in ms:
                            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                            times.append(time_us([lambda p=p: q4_k.gemv_q4k(x, p, n, k, workspace=ws, config=cfg)
                                                   for p in planes], runs=30))
                        results.append((statistics.mean(times), times, cfg))
        results.sort(key=lambda r: r[0])
        qbytes = n * k * 148 // 256
        print(f"{name} {n}x{k}: current {q4_k.gemv_config(n, k)}")
        for mean_t, times, cfg in results[:5]:
            print(f"   {mean_t:8.2f} us {qbytes / mean_t / 1e3:6.0f} GB/s  per M {[round(t, 2) for t in times]}  {cfg}",
                  flush=True)
        del planes
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- dp4a GEMVs


def sweep_against(name: str, make_planes, dequant_call, dp4a_call, workspace_fn, bytes_per_value: float,
                  shapes=None, ms=(1, 8)) -> None:
    """Per shape and M (CUDA): the dequantizing GEMV's µs (`dequant_call(x, planes, n, k, out, ws)`,
    ws a workspace of `workspace_fn(n, k, None)` elements), then the five fastest dp4a configurations'
    (`dp4a_call(x, planes, n, k, out, ws, cfg)`, ws of `workspace_fn(n, k, cfg)`), weight copies cycled
    past L2 so every call reads HBM. What `DP4A_MAX_ROWS` and the dp4a `gemv_config`s come from."""
    from strata.kernels.quant.dp4a import Dp4aConfig

    for n, k in shapes or [(n, k) for _, n, k in SHAPES]:
        planes = make_planes(n, k)
        copies = _clones(planes, n, k)
        qbytes = n * k * bytes_per_value
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            base_ws = torch.zeros(max(1, workspace_fn(n, k, None)), dtype=torch.int32, device="cuda")
            base = time_us([lambda p=p: dequant_call(x, p, n, k, out, base_ws) for p in copies], runs=30)
            results = []
            for block_n in (32, 64, 128):
                for block_k in (128, 256):
                    for split in (1, 2, 4, 8):
                        for warps in (4, 8):
                            cfg = Dp4aConfig(block_n, block_k, split, warps)
                            if split > max(1, k // block_k // 2):
                                continue
                            ws = torch.zeros(max(1, workspace_fn(n, k, cfg)), dtype=torch.int32, device="cuda")
                            results.append((time_us([lambda p=p: dp4a_call(x, p, n, k, out, ws, cfg) for p in copies],
                                                    runs=30), cfg))
            results.sort(key=lambda r: r[0])
            print(f"{name} {n}x{k} M={m}: dequant {base:7.2f} us {qbytes / base / 1e3:5.0f} GB/s", flush=True)
            for t, cfg in results[:5]:
                print(f"   dp4a {t:7.2f} us {qbytes / t / 1e3:5.0f} GB/s  {cfg}", flush=True)
        del copies, planes
        torch.cuda.empty_cache()


def sweep_dp4a(fmt: str, shapes=None, ms=(1, 8)) -> None:
    """The format's dequantizing GEMV (its own configuration, whichever decode kernel the format would
    pick) against the dp4a GEMV's configurations."""
    from strata.kernels.quant import dp4a, iq3_s, iq3_s_dp4a, q4_k, q4_k_dp4a, q6_k, q6_k_dp4a, q8_0

    def raw_planes(mod):
        return lambda n, k: mod.repack(torch.from_numpy(mod.random_raw(n, k, seed=n + k)).cuda())

    if fmt == "Q8_0":
        sweep_against("Q8_0", raw_planes(q8_0),
                      lambda x, p, n, k, out, ws: q8_0.matmul_triton(x, p, n, k, out, workspace=ws,
                                                                     config=q8_0.gemv_config(n, k)),
                      lambda x, p, n, k, out, ws, cfg: dp4a.q8_gemv_dp4a(x, p["qs"], p["d"], out, workspace=ws,
                                                                         config=cfg),
                      lambda n, k, cfg: q8_0.gemv_workspace_numel(n, k) if cfg is None else dp4a.workspace_numel(n, k, cfg),
                      34 / 32, shapes, ms)
    elif fmt == "Q4_K":
        sweep_against("Q4_K", raw_planes(q4_k),
                      lambda x, p, n, k, out, ws: q4_k.gemv_q4k(x, p, n, k, out, workspace=ws),
                      lambda x, p, n, k, out, ws, cfg: q4_k_dp4a.q4k_gemv_dp4a(x, p, n, k, out, workspace=ws,
                                                                               config=cfg),
                      lambda n, k, cfg: q4_k.gemv_workspace_numel(n, k) if cfg is None
                      else q4_k_dp4a.workspace_numel(n, k, cfg),
                      144 / 256, shapes, ms)
    elif fmt == "Q6_K":
        def q6_planes(n, k):
            return q6_k.repack(random_blocks("Q6_K", n, k, torch.Generator("cuda").manual_seed(n + k), "cuda"))

        sweep_against("Q6_K", q6_planes,
                      lambda x, p, n, k, out, ws: q6_k.gemv_q6k(x, p, n, k, out, workspace=ws),
                      lambda x, p, n, k, out, ws, cfg: q6_k_dp4a.q6k_gemv_dp4a(x, p, n, k, out, workspace=ws,
                                                                               config=cfg),
                      lambda n, k, cfg: q6_k.gemv_workspace_numel(n, k) if cfg is None
                      else q6_k_dp4a.workspace_numel(n, k, cfg),
                      210 / 256, shapes or [(n, k) for _, n, k in SHAPES] + [LM_HEAD_SHAPE], ms)
    elif fmt == "IQ3_S":
        grid = iq3_s.grid_table(torch.device("cuda"))
        sweep_against("IQ3_S", raw_planes(iq3_s),
                      lambda x, p, n, k, out, ws: iq3_s.matmul(x, p, n, k, out, config=iq3_s.gemv_config(n, k)),
                      lambda x, p, n, k, out, ws, cfg: iq3_s_dp4a.iq3s_gemv_dp4a(x, p, grid, n, k, out, workspace=ws,
                                                                                 config=cfg),
                      lambda n, k, cfg: 1 if cfg is None else iq3_s_dp4a.workspace_numel(n, k, cfg),
                      110 / 256, shapes, ms)
    else:
        raise ValueError(f"no dp4a GEMV for {fmt}")


# ---------------------------------------------------------------------------------------------- stream-K


def bench_streamk(shapes=((4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)), ms=(512, 4096),
                  runs: int = 30) -> list[dict]:
    """µs and TFLOP/s of the Q8_0 stream-K GEMM (`strata.kernels.quant.streamk`, context reserved for
    the device's SM count) against the tiled `q8_0.matmul` per shape and M."""
    from strata.kernels.quant import q8_0
    from strata.kernels.quant.streamk import QMatmulContext, q8_0_matmul_streamk

    ctx = QMatmulContext("cuda")
    ctx.reserve_fixup(QMatmulContext.largest_fixup(torch.cuda.get_device_properties(0).multi_processor_count))
    rows = []
    for n, k in shapes:
        planes = q8_0.repack(torch.from_numpy(q8_0.random_raw(n, k, seed=n + k)).cuda())
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            sk = time_us([lambda: q8_0_matmul_streamk(x, planes, n, k, ctx, out)], runs)
            tiled = time_us([lambda: q8_0.matmul(x, planes, n, k, out)], runs)
            flop = 2 * m * n * k / 1e6
            rows.append(dict(n=n, k=k, m=m, streamk_us=sk, tiled_us=tiled))
            print(f"Q8_0 {n}x{k} M={m}: stream-K {sk:8.2f} us {flop / sk:6.1f} TFLOP/s | "
                  f"tiled {tiled:8.2f} us {flop / tiled:6.1f} TFLOP/s | x{tiled / sk:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the GGUF formats' kernels against bf16 on the GPU, and their sweeps")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--sweep", choices=["Q8_0", "Q4_K"], help="sweep the format's dequantizing GEMV configurations")
    what.add_argument("--dp4a", choices=["Q8_0", "Q4_K", "Q6_K", "IQ3_S"],
                      help="the dequantizing GEMV against the format's dp4a GEMV configurations")
    what.add_argument("--streamk", action="store_true", help="the Q8_0 stream-K GEMM against the tiled GEMM")
    parser.add_argument("--formats", default=",".join(FORMATS), help="for the table: comma-separated formats")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    parser.add_argument("--shapes", nargs="*", metavar="NxK", help="weight shapes (default: Qwen3-8B's)")
    args = parser.parse_args(argv)
    require_cuda()
    ms = parse_ints(args.ms)
    pairs = parse_shapes(args.shapes)
    named = [(f"{n}x{k}", n, k) for n, k in pairs] if pairs else SHAPES
    if args.sweep == "Q8_0":
        sweep_q8_0_gemv(named, ms or (1, 8))
    elif args.sweep == "Q4_K":
        sweep_q4_k_gemv(named, ms or (1, 8))
    elif args.dp4a:
        sweep_dp4a(args.dp4a, pairs, ms or (1, 8))
    elif args.streamk:
        bench_streamk(pairs or ((4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)), ms or (512, 4096))
    else:
        for fmt in args.formats.split(","):
            print(f"== {fmt}", flush=True)
            bench_format(format_module(fmt), ms or (1, 4096), named)


if __name__ == "__main__":
    main()
