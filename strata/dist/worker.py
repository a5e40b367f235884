"""`python -m strata.dist.worker`: one pipeline stage started by rank 0's machine (`strata.dist.launch`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch.distributed as dist

from strata.config import EngineConfig
from strata.dist.launch import JOIN_TIMEOUT, init_group, plan_for
from strata.dist.stage import run_stage


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata.dist.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--local", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    a = p.parse_args(argv)
    logger = logging.getLogger("strata")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"strata[stage {a.rank}]: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
    cfg = EngineConfig(**json.loads(a.config))
    host, _, port = a.store.rpartition(":")
    store = dist.TCPStore(host, int(port), a.world, is_master=False, timeout=JOIN_TIMEOUT)
    plan = plan_for(cfg, a.rank, a.world, a.local)
    ctrl, data = init_group(cfg, plan, store, plan.device.startswith("cuda"))
    run_stage(cfg, plan, ctrl, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
