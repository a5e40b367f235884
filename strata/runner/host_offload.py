"""Start-up of the MoE layers whose routed experts the memory plan left in host RAM, on CUDA: the pinned
staging their decode rows pass through to the CPU, the streamer that brings their experts up to the GPU
for steps of `--expert-stream-tokens` tokens or more (measured here when not given), and where decode
steps compute them (`--host-expert-decode`: on the CPU, or read in place by the GPU's kernels)."""

from __future__ import annotations

import logging
import time

import torch

from strata.config import EngineConfig, ModelConfig
from strata.kernels.moe_decode import moe_experts_decode_ref
from strata.kernels.quant import moe_decode_q
from strata.models.host_experts import (COMPILED, ExpertStreamer, HostStaging, HostStagingPool, host_step_seconds,
                                        stream_crossover)
from strata.models.moe import MoE, grouped_mm_works, pcie_decode, pcie_serves

log = logging.getLogger("strata")


def set_up_host_experts(model: torch.nn.Module, mc: ModelConfig, cfg: EngineConfig, device: torch.device
                        ) -> tuple[HostStagingPool | None, ExpertStreamer | None]:
    """The staging pool and the streamer (None where not used) of `model`'s layers with experts in RAM,
    handed to each of those layers."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.host is not None]
    if not moes or device.type != "cuda":
        return None, None
    computed = [m for m in moes if m.host.on_cpu]  # the others: the file's blocks alone, for the GPU
    if cfg.batch_invariant and len(computed) < len(moes):
        raise ValueError("--batch-invariant computes experts in RAM on the CPU: they need a CPU copy "
                         "(--host-experts other than file)")
    warm_compiled_steps(computed, mc.num_experts_per_tok)
    chunk = cfg.max_num_batched_tokens or 2048
    streams = ((cfg.expert_stream_tokens != 0 or len(computed) < len(moes))
               and all(m.host.stream is not None for m in moes))
    streamer = ExpertStreamer(moes, device) if streams else None
    threshold = cfg.expert_stream_tokens or 0
    if streamer is not None:
        streamer.probe_float(grouped_mm_works)
        if cfg.expert_stream_tokens is None and computed:
            act = cfg.torch_dtype if computed[0].host.fmt == "float" else torch.float32
            threshold = measure_stream_crossover(computed, streamer, mc.num_experts_per_tok, act, chunk)
        if threshold > chunk and computed == moes:  # no step is that large: the CPU computes them all
            streamer, threshold = None, 0
    choose_host_decode(moes, cfg.host_expert_decode, mc.num_experts_per_tok, cfg.torch_dtype, device)
    rows = cfg.parallel * (1 + cfg.spec)
    tokens = max(rows, threshold - 1 if streamer else chunk)
    pool = HostStagingPool(tokens, mc.hidden_size, mc.num_experts_per_tok, cfg.torch_dtype, device)
    pool.reserve([torch.cuda.current_stream(device)])
    for m in moes:
        m.host_staging, m.streamer = pool, streamer
        m.stream_min_tokens = threshold if streamer else 0
    buffers = f"2 x {streamer.nbytes / 2 / 2**20:.0f} MiB" if streamer else ""
    if computed:
        fmt = ", ".join(sorted({m.host.fmt for m in computed}))
        log.info("routed experts of %d MoE layers in host RAM (%s, %.2f GiB): steps of fewer than %s tokens on the "
                 "CPU%s", len(computed), fmt, sum(m.host.nbytes for m in computed) / 2**30,
                 threshold if streamer and threshold else "any number of",
                 f", larger ones streamed to the GPU through {buffers}" if streamer and threshold else "")
    if len(computed) < len(moes):
        alone = [m for m in moes if not m.host.on_cpu]
        log.info("routed experts of %d MoE layers in host RAM in the GPU's format alone (file, %.2f GiB): steps the "
                 "fused decode kernels do not read over PCIe stream them to the GPU through %s", len(alone),
                 sum(m.host.nbytes for m in alone) / 2**30, buffers)
    return pool, streamer


def choose_host_decode(moes: list[MoE], way: str, k: int, dtype: torch.dtype, device: torch.device) -> str:
    """`--host-expert-decode`: "pcie" hands each layer the pinned stacks kept for streaming (`pcie_stacks`),
    which the GPU's fused decode kernels read in place, when every layer has them and the kernels serve a
    one-token step over them and give what the CPU's copy gives; "both" does too, with each row's first
    `cpu_slots` chosen experts left to the CPU, at the count one layer's step measured fastest
    (`split_step_seconds`); "auto" takes the fastest of all counts, none (pcie) to every one (cpu); else
    "cpu". The quantized kernels' tiles over PCIe are the fastest of `fastest_pcie_config`'s
    (`MoE.pcie_config`)."""
    for m in moes:  # a model set up before (a benchmark's next engine) starts from the CPU again
        m.pcie_stacks = m.pcie_config = None
        m.cpu_slots = 0
    if not all(m.host.on_cpu for m in moes) and way != "pcie":
        if way != "auto":
            log.warning("--host-expert-decode %s: some experts in RAM have no CPU copy (host_experts file); "
                        "decode steps read them over PCIe", way)
        way = "pcie"
    if way == "cpu":
        return "cpu"
    stacks = [pcie_stacks_of(m, k, dtype, device) for m in moes]
    why = ("a layer without a pinned copy in the GPU's format, or one the fused decode kernels do not take "
           "from host memory" if any(s is None for s in stacks) else "")
    largest = max(range(len(moes)), key=lambda i: moes[i].host.nbytes)
    config, cpu_slots = None, 0
    if not why:
        config, _ = fastest_pcie_config(moes[largest].host, stacks[largest], k, dtype, device)
    if not why and way in ("auto", "both"):
        seconds = {c: split_step_seconds(moes[largest].host, stacks[largest], k, c, dtype, device, config)
                   for c in split_counts(k, way) or [0]}
        cpu_slots = min(seconds, key=seconds.get)
        log.info("a decode row through one layer's experts in RAM, by how many of its %d experts the CPU "
                 "computes while the GPU reads the others over PCIe: %s", k,
                 ", ".join(f"{c} {s * 1e3:.3f} ms" for c, s in seconds.items()))
        if cpu_slots == k:
            why = "slower than the CPU"
    if why:
        (log.warning if way in ("pcie", "both") else log.info)(
            "decode steps compute the experts in RAM on the CPU (PCIe reads: %s)%s", why,
            "" if all(m.host.on_cpu for m in moes) else "; those without a CPU copy are streamed to the GPU")
        return "cpu"
    for m, st in zip(moes, stacks):
        m.pcie_stacks, m.cpu_slots = st, cpu_slots
        m.pcie_config = config if _shape_of(st) == _shape_of(stacks[largest]) else None
    tiles = f"; K steps of {config.gate_up_block_k} values" if config is not None else ""
    if cpu_slots:
        warm_compiled_steps(moes, cpu_slots)
        log.info("decode steps of up to 16 tokens: of each row's %d experts in RAM, the CPU computes %d while the "
                 "GPU's kernels read the other %d from host RAM (%d MoE layers%s)", k, cpu_slots, k - cpu_slots,
                 len(moes), tiles)
        return "both"
    log.info("decode steps of up to 16 tokens read the chosen experts of %d MoE layers from host RAM in the "
             "GPU's kernels (no wait for the host; one CUDA graph a step%s)", len(moes), tiles)
    return "pcie"


def pcie_stacks_of(moe: MoE, k: int, dtype: torch.dtype, device: torch.device) -> tuple | None:
    """The layer's pinned stacks (`HostExperts.stream`) when the fused decode kernels, run on `device`, read
    them in place and their sum for a few rows is within 5% of the CPU copy's; else None."""
    host = moe.host
    if host.stream is None:
        return None
    stacks = host.stream.stacks(host.stream.region)
    x, ids, w = _probe_rows(host, k, 0)
    x = x.to(device, dtype)
    if not pcie_serves(x, k, *stacks):
        return None
    try:
        got = pcie_decode(x, ids.to(device), w.to(device), *stacks).float().cpu()
    except Exception as err:  # noqa: BLE001 - the kernels cannot take host pointers here: the CPU serves
        log.info("the fused decode kernels cannot read experts in host memory here (%s)", str(err).splitlines()[0][:200])
        return None
    if host.on_cpu:
        ref = host._forward(x.cpu() if host.fmt == "float" else x.float().cpu(), ids, w, None).float()
    else:
        ref = stacks_reference(stacks, x, ids.to(device), w.to(device)).cpu()
    return stacks if float((got - ref).norm()) <= 0.05 * float(ref.norm()) else None


def stacks_reference(stacks: tuple, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the fused decode kernels give for rows x over (w13, w2) wherever those lie, in fp32: their
    definition on the chosen experts alone, dequantized on x's device (`moe_decode_q_ref`; float stacks:
    the chosen experts copied there)."""
    w13, w2 = stacks
    if not isinstance(w13, torch.Tensor):
        return moe_decode_q.moe_decode_q_ref(x, ids, w, w13, w2).float()
    used = torch.unique(ids).tolist()
    index = torch.full((w13.shape[0],), -1, dtype=torch.long)
    index[used] = torch.arange(len(used))
    f13, f2 = (torch.stack([s[e] for e in used]).to(x.device, torch.float32) for s in (w13, w2))
    return moe_experts_decode_ref(x, index.to(ids.device)[ids], w, f13, f2).float()


def _probe_rows(host, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two fp32 rows for `host`'s layer, k distinct experts each and their routing weights, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, host.gate_up.k, generator=g)
    ids = torch.rand(2, host.num_experts, generator=g).argsort(dim=1)[:, :k].contiguous()
    return x, ids, torch.softmax(torch.randn(2, k, generator=g), dim=-1)


def _shape_of(stacks: tuple) -> tuple | None:
    """What a quantized kernel configuration depends on: (format, H, I); None for float stacks."""
    w13, w2 = stacks
    return None if isinstance(w13, torch.Tensor) else (w13.ggml_type, w13.k, w2.k)


def fastest_pcie_config(host, stacks: tuple, k: int, dtype: torch.dtype, device: torch.device):
    """(config, seconds): among the quantized kernels' tile configurations for reads over PCIe
    (`moe_decode_q.pcie_configs`; None for float stacks, or the default), the one a decode row through
    `stacks` takes least time with, of those whose sum is within 1% of the default's (a tile shape the
    device miscompiles is left out)."""
    shape = _shape_of(stacks)
    configs = moe_decode_q.pcie_configs(*shape) if shape is not None else [None]
    if len(configs) == 1:
        return None, pcie_step_seconds(host, stacks, k, dtype, device)
    x, ids, w = _probe_rows(host, k, 2)
    x, ids, w = x.to(device, dtype), ids.to(device), w.to(device)
    ref = pcie_decode(x, ids, w, *stacks).float()
    best = None
    for config in configs:
        if config is not configs[0]:
            try:
                got = pcie_decode(x, ids, w, *stacks, config=config).float()
            except Exception as err:  # noqa: BLE001 - a tile shape this device cannot build: the others serve
                log.info("PCIe tiles %s unavailable (%s)", config, str(err).splitlines()[0][:200])
                continue
            if float((got - ref).norm()) > 0.01 * float(ref.norm()):
                log.info("PCIe tiles %s left out: their sum is not the default tiles'", config)
                continue
        seconds = pcie_step_seconds(host, stacks, k, dtype, device, config=config)
        if best is None or seconds < best[1]:
            best = (config, seconds)
    config, seconds = best
    return (None if config is configs[0] else config), seconds


def pcie_step_seconds(host, stacks: tuple, k: int, dtype: torch.dtype, device: torch.device, repeats: int = 4,
                      config=None) -> float:
    """One decode row through the fused decode kernels over the pinned `stacks` (best of `repeats`), each
    repeat choosing experts no earlier one chose where there are enough, so none is read from the GPU's cache;
    `config`: the quantized kernels' tiles."""
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(host.num_experts, generator=g)
    x = torch.randn(1, host.gate_up.k, generator=g).to(device, dtype)
    w = torch.softmax(torch.randn(1, k, generator=g), dim=-1).to(device)
    best = float("inf")
    for r in range(repeats + 1):  # the first builds and warms the kernels
        at = (r * k) % max(host.num_experts - k + 1, 1)
        ids = order[at : at + k].view(1, k).to(device)
        _sync(device)
        t0 = time.perf_counter()
        pcie_decode(x, ids, w, *stacks, config=config)
        _sync(device)
        if r:
            best = min(best, time.perf_counter() - t0)
    return best


def split_step_seconds(host, stacks: tuple, k: int, cpu_slots: int, dtype: torch.dtype, device: torch.device,
                       config=None, repeats: int = 4) -> float:
    """One decode row through a layer's experts in RAM (best of `repeats`, each on experts no earlier one
    chose where there are enough), its first `cpu_slots` of `k` chosen experts computed by the CPU while
    the GPU's fused decode kernels read the others over PCIe, as an eager step runs it (`MoE._both`):
    the row down to pinned staging, the read queued, the CPU's part through the kernel a one-token step
    takes, its sum up and added. 0: the GPU reads them all (no copy); k: the CPU computes them all."""
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(host.num_experts, generator=g)
    x = torch.randn(1, host.gate_up.k, generator=g).to(device, dtype)
    w = torch.softmax(torch.randn(1, k, generator=g), dim=-1).to(device)
    c = cpu_slots
    staging = HostStaging(1, host.gate_up.k, k, dtype, device) if device.type == "cuda" and c else None
    seconds, read = host.seconds, host.bytes_read
    best = float("inf")
    for r in range(repeats + 2):  # the first two build the kernels and wake the CPU's threads
        at = (r * k) % max(host.num_experts - k + 1, 1)
        ids = order[at : at + k].view(1, k).to(device)
        _sync(device)
        t0 = time.perf_counter()
        if staging is not None:
            xh, idh, wh = staging.down(x, ids[:, :c], w[:, :c])
        total = pcie_decode(x, ids[:, c:].contiguous(), w[:, c:].contiguous(), *stacks, config=config) if c < k else None
        if c:
            if staging is not None:
                staging.event.synchronize()
                part = staging.up(host._forward(xh, idh, wh, staging.out[:1]))
            else:
                part = host._forward(x if host.fmt == "float" else x.float(), ids[:, :c], w[:, :c], None).to(dtype)
            total = part if total is None else total + part
        _sync(device)
        if r > 1:
            best = min(best, time.perf_counter() - t0)
    host.seconds, host.bytes_read = seconds, read
    return best


def split_counts(k: int, way: str) -> list[int]:
    """The CPU's shares of a row's k experts the start-up probe times (each a kernel of its own to build
    for the compiled formats): a quarter, half and three quarters, and under "auto" none and all too."""
    inner = sorted({min(max(round(k * f), 1), k - 1) for f in (0.25, 0.5, 0.75)} if k > 1 else set())
    return inner if way == "both" else [0, *inner, k]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_compiled_steps(moes: list[MoE], k: int) -> None:
    """A step of one token and one of two through each distinct layer shape of the compiled format, so
    its kernels are generated at start-up, not in the first requests."""
    seen = set()
    for m in moes:
        host = m.host
        shape = (host.num_experts, host.down.k, host.gate_up.k)
        if host.fmt not in COMPILED or (host.fmt, shape) in seen:
            continue
        seen.add((host.fmt, shape))
        t0 = time.perf_counter()
        seconds, read = host.seconds, host.bytes_read
        for t in (1, 2):
            host.forward(torch.zeros(t, host.gate_up.k), torch.arange(k).repeat(t, 1), torch.ones(t, k))
        host.seconds, host.bytes_read = seconds, read
        log.info("%s expert kernels for %d experts of %d x %d generated in %.1f s", host.fmt, *shape,
                 time.perf_counter() - t0)


def measure_stream_crossover(moes: list[MoE], streamer: ExpertStreamer, k: int, act: torch.dtype, chunk: int) -> int:
    """`--expert-stream-tokens` measured: the largest layer's copy to the GPU against the CPU time of steps
    of 1, 2, 4 .. tokens through it (uniformly routed rows, `k` experts each), up to the largest step."""
    copy = streamer.copy_seconds()
    host = max(moes, key=lambda m: m.host.nbytes).host
    cpu: dict[int, float] = {}
    t = 1
    while True:
        cpu[t] = host_step_seconds(host, t, k, act)
        if cpu[t] >= copy or t >= chunk:
            break
        t *= 2
    threshold = stream_crossover(cpu, copy)
    log.info("expert streaming measured: a layer's copy %.2f ms; on the CPU %s: steps of %d tokens or more stream",
             copy * 1e3, ", ".join(f"{n} tokens {s * 1e3:.2f} ms" for n, s in cpu.items()), threshold)
    return threshold
