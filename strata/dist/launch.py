"""Joining the pipeline's process group.

Three ways in, one code path after: `strata serve|generate --split-mode layer` on one machine starts
the other stages itself (one process each, `strata.dist.worker`, on a TCPStore of its own on
127.0.0.1); under `torchrun` every rank runs the same command and torch's rendezvous joins them; with
`--dist-init-addr HOST:PORT --nnodes N --node-rank K` each machine runs the same command, node 0's
process listening at HOST:PORT, and each starts its own other stages. Rank 0 returns a `Link` and goes
on as the engine; any other rank runs its stage and exits (`SystemExit`) when rank 0 stops it.
GPUs use NCCL for the hidden states and a gloo group for the metadata; the CPU uses gloo for both.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from strata.config import EngineConfig
from strata.dist.link import Link
from strata.dist.plan import StagePlan, layer_ranges, parse_devices, parse_shares, stage_count, stage_device
from strata.env import ENV
from strata.loaders import read_model

log = logging.getLogger("strata")

# An idle server's stages wait for the next step in a receive bounded by the group's timeout.
IDLE_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT = timedelta(minutes=10)


def plan_for(cfg: EngineConfig, rank: int, world: int, local: int) -> StagePlan:
    """This rank's view of the pipeline: the model's layers by --tensor-split, its device by --devices."""
    _, mc = read_model(cfg.model)
    cuda = cfg.resolved_device.startswith("cuda")
    ranges = layer_ranges(mc.num_hidden_layers, parse_shares(cfg.tensor_split, world))
    devices = parse_devices(cfg.devices)
    device = stage_device(local, devices, cuda)
    return StagePlan(rank, world, tuple(ranges), device, devices.count(device) if cuda and devices else 1)


def _world(cfg: EngineConfig) -> int:
    cuda = cfg.resolved_device.startswith("cuda")
    count = torch.cuda.device_count() if cuda else 0
    return stage_count(cfg.tensor_split, parse_devices(cfg.devices), cfg.nnodes, count, cuda)


def init_group(cfg: EngineConfig, plan: StagePlan | None, store, cuda: bool) -> tuple[object, object]:
    """Join the default group (NCCL on GPUs, gloo on the CPU; `store` None: torchrun's env://) and
    return (control group, data group): a gloo group for the metadata and the default group on GPUs,
    the default group for both on the CPU (None)."""
    if cuda and plan is not None:
        torch.cuda.set_device(torch.device(plan.device))
    kwargs = {"store": store, "rank": plan.rank, "world_size": plan.world} if store is not None else {"init_method": "env://"}
    devices = parse_devices(cfg.devices) or []
    # NCCL refuses two ranks on one GPU: stages sharing a card use gloo through host buffers.
    nccl = cuda and len(set(devices)) == len(devices)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=JOIN_TIMEOUT if nccl else IDLE_TIMEOUT, **kwargs)
    if not nccl:
        return None, None
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), None


def refuse(cfg: EngineConfig) -> None:
    """What does not run across stages, refused before any stage starts."""
    if cfg.kv_resident is not None or cfg.kv_host_memory is not None:
        raise ValueError("the host KV tier (--kv-resident, --kv-host-memory) does not run across pipeline stages yet")
    if ENV.PIPED_CONCURRENT.get() and ENV.SPLIT_MTP_BATCH.get() and ENV.PIPED_CONCURRENT_SMB.get():
        raise ValueError("STRATA_PIPED_CONCURRENT_SMB does not run across pipeline stages: the read's MTP K/V "
                         "would be written on rank 0, and the MTP head is the last stage's")


def join(cfg: EngineConfig) -> Link | None:
    """Rank 0: the link to the other stages (None when there is one stage). Other ranks never return."""
    refuse(cfg)
    world = _world(cfg)
    if world < 2:
        log.info("--split-mode layer with one stage: nothing to split")
        return None
    if cfg.nnodes > 1 and world % cfg.nnodes:
        raise ValueError(f"{world} stages do not divide over {cfg.nnodes} machines")
    per_node = world // cfg.nnodes
    cuda = cfg.resolved_device.startswith("cuda")
    if cuda:
        # What an engine this process ran before (a test's, a benchmark's arm) left in torch's cache or in
        # a reference cycle is released before the stages on this card measure what they may take of it.
        gc.collect()
        torch.cuda.empty_cache()
    children: list = []
    if dist.is_torchelastic_launched():
        ctrl, data = init_group(cfg, None, None, cuda)
        rank = dist.get_rank()
        if dist.get_world_size() != world:
            raise ValueError(f"torchrun started {dist.get_world_size()} processes for {world} stages")
        plan = plan_for(cfg, rank, world, rank % per_node)
        if cuda:
            torch.cuda.set_device(torch.device(plan.device))
    else:
        host, port = "127.0.0.1", 0
        if cfg.dist_init_addr:
            host, _, p = cfg.dist_init_addr.rpartition(":")
            if not host or not p.isdigit():
                raise ValueError(f"--dist-init-addr must be HOST:PORT, not {cfg.dist_init_addr!r}")
            port = int(p)
        rank = cfg.node_rank * per_node
        plan = plan_for(cfg, rank, world, 0)
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        children = [(rank + i, _spawn(cfg, rank + i, world, i, host, store.port)) for i in range(1, per_node)]
        ctrl, data = init_group(cfg, plan, store, cuda)
    if rank != 0:
        from strata.dist.stage import run_stage

        run_stage(cfg, plan, ctrl, data)
        for _, p in children:
            p.wait()
        raise SystemExit(0)
    return Link(plan, ctrl, data, children)


def _spawn(cfg: EngineConfig, rank: int, world: int, local: int, host: str, port: int) -> subprocess.Popen:
    options = json.dumps(dataclasses.asdict(cfg))
    cmd = [sys.executable, "-m", "strata.dist.worker", "--rank", str(rank), "--world", str(world),
           "--local", str(local), "--store", f"{host}:{port}", "--config", options]
    # stdout carries generated text only: a stage writes its logs to stderr.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
