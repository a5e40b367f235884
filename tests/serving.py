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
from typing import Any, Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(tmp, config: dict, extra_args: list[str] = ()) -> Iterator[str]:
    """Yields the base URL of a server started with `--config` holding `config`; stops it with SIGINT,
    which must drain it cleanly (exit status 0)."""
    proc, base, log = start_server(tmp, config, extra_args)
    try:
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=20)
            log.seek(0)
            assert code == 0, f"exit {code}, not the 0 of a clean drain on SIGINT:\n{log.read()[-3000:]}"
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()


def start_server(tmp, config: dict, extra_args: list[str] = (), preexec=None) -> tuple[subprocess.Popen, str, Any]:
    """(process, base URL, log file) of a server started with `--config` holding `config`, once its
    /health answers; `preexec` runs in the child before exec (limits)."""
    cfg = tmp / "strata.json"
    cfg.write_text(json.dumps(config))
    port = free_port()
    log = open(tmp / "server.log", "w+")
    env = {**os.environ, "STRATA_NO_PROGRESS": "1"}
    # SIGINT back to its default in the server: a shell ignores it in the commands it starts in the
    # background, pytest-xdist's workers too, and an ignored signal is inherited across exec (the
    # server would never see the SIGINT that stops it).
    def child() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if preexec is not None:
            preexec()

    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--config", str(cfg), "--port", str(port),
                             *extra_args], stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=child)
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
    return proc, base, log


def server_log(proc: subprocess.Popen, log: Any) -> str:
    """The log of a server `start_server` started, once it has ended (killed if it has not)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.seek(0)
    text = log.read()
    log.close()
    return text
