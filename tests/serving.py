"""Starts a real `strata serve` process on 127.0.0.1 for a test module and stops it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(tmp, config: dict, extra_args: list[str] = ()) -> Iterator[str]:
    """Yields the base URL of a server started with `--config` holding `config`."""
    cfg = tmp / "strata.json"
    cfg.write_text(json.dumps(config))
    port = free_port()
    log = open(tmp / "server.log", "w+")
    env = {**os.environ, "STRATA_NO_PROGRESS": "1"}
    # SIGINT back to its default in the server: a shell ignores it in the commands it starts in the
    # background, pytest-xdist's workers too, and an ignored signal is inherited across exec; uvicorn
    # re-raises the SIGINT it caught after its shutdown, and it would then be ignored (exit 0, not 130).
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--config", str(cfg), "--port", str(port),
                             *extra_args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not come up in 120 s")
        time.sleep(0.1)
    try:
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=20)
            log.seek(0)
            assert code == 130, f"exit {code}, not the 130 of a clean stop on SIGINT:\n{log.read()[-3000:]}"
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
