"""Start-up failures are one line naming what to change, never a traceback: a model too big for the
GPU (torch's out-of-memory error, raised here without a GPU)."""

from __future__ import annotations

import argparse

import torch

from strata.cli_args import run_command


def test_out_of_memory_at_start_up_is_one_line(capsys):
    def start(_: argparse.Namespace) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    assert run_command(argparse.Namespace(command="generate", func=start)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out of GPU memory" in err and "--ctx" in err and "Tried to allocate" in err
