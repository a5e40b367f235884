"""Connections under a budget: uvicorn's h11 protocol with a header deadline and a cap.

- A connection has `header_timeout` seconds to send a request's headers, counted from when it opened
  (or finished its previous response), however slowly it trickles bytes: then it is closed. The body
  has `ServerConfig.body_timeout` (`strata.server.request_body`), an idle keep-alive connection
  uvicorn's `timeout_keep_alive`.
- At most `max_connections` are open (kept below the open-file limit, so accept() never runs out of
  descriptors). A new connection over the cap closes the oldest one still waiting for its headers (a
  client that sent nothing yet, or an idle keep-alive one) and takes its place; when every open
  connection has a request in progress, the new one is answered 503 and closed.
- Accept errors (the process out of descriptors all the same) are logged as one line, at most once
  every ACCEPT_ERROR_LOG_S seconds, not a traceback per attempt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("strata")

ACCEPT_ERROR_LOG_S = 30.0
SPARE_FDS = 32  # descriptors kept free beyond the connections and one accept burst (logs, files, threads)

_BODY = json.dumps({"error": {"message": "the server has too many open connections; retry later",
                              "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
SERVICE_UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                       b"retry-after: 1\r\nconnection: close\r\ncontent-length: " + str(len(_BODY)).encode()
                       + b"\r\n\r\n" + _BODY)


def connection_budget(wanted: int) -> tuple[int, int]:
    """(connections, listen backlog): `wanted` connections, lowered so that they, one accept burst of
    `backlog` (asyncio accepts that many before any of them is seen) and the descriptors already open
    fit the process's open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted, 2048
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    free = max(soft - used, 2)
    # A deep queue: a burst of connections waits in it instead of having its SYNs dropped (a second's retry).
    backlog = min(max(free // 2, 16), 2048)
    cap = min(wanted, max(free - backlog - SPARE_FDS, 1))
    if cap < wanted:
        log.info("at most %d open connections (--max-connections %d): the open-file limit is %d", cap, wanted, soft)
    return cap, backlog


def guarded_protocol(max_connections: int, header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol under the rules above (a class for `uvicorn.Config(http=...)`)."""

    class GuardedH11Protocol(H11Protocol):
        cap = max_connections
        deadline_s = header_timeout

        def _waiting(self) -> OrderedDict:
            """This server's connections waiting for request headers, oldest first."""
            state = self.server_state
            if not hasattr(state, "strata_waiting"):
                state.strata_waiting = OrderedDict()
            return state.strata_waiting

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._timer: asyncio.TimerHandle | None = None
            self._armed_cycle: Any = None
            waiting = self._waiting()
            if len(self.connections) >= self.cap:
                if waiting:
                    oldest, _ = waiting.popitem(last=False)
                    oldest.transport.close()
                else:
                    self.transport = transport
                    transport.write(SERVICE_UNAVAILABLE)
                    transport.close()
                    return
            super().connection_made(transport)
            self._await_headers()

        def _await_headers(self) -> None:
            self._armed_cycle = self.cycle
            self._waiting()[self] = None
            if self._timer is not None:
                self._timer.cancel()
            if self.deadline_s > 0:
                self._timer = self.loop.call_later(self.deadline_s, self._headers_late)

        def _headers_seen(self) -> None:
            if self._armed_cycle is not self.cycle:  # a new request began: its headers are complete
                self._waiting().pop(self, None)
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                self._armed_cycle = self.cycle

        def _headers_late(self) -> None:
            self._timer = None
            if self._armed_cycle is self.cycle and not self.transport.is_closing():
                self._waiting().pop(self, None)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._headers_seen()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._await_headers()  # before super(): it may start a pipelined request at once
            super().on_response_complete()
            self._headers_seen()

        def connection_lost(self, exc: Exception | None) -> None:
            self._waiting().pop(self, None)
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's exception handler, with accept() running out of descriptors (or memory) logged as one
    line at most every ACCEPT_ERROR_LOG_S seconds."""
    previous = loop.get_exception_handler()
    last = [0.0]

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        e = context.get("exception")
        if isinstance(e, OSError) and "accept" in str(context.get("message", "")):
            now = time.monotonic()
            if now - last[0] >= ACCEPT_ERROR_LOG_S:
                last[0] = now
                log.warning("cannot accept connections: %s (lower --max-connections or raise the open-file "
                            "limit, ulimit -n)", e)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
