"""What `strata tui` asks a running server: `GET /strata/slots`, `GET /v1/models` and streamed chat completions.

Only the public HTTP API is used, so the server may be on another machine. Every failure becomes a
`ServerUnavailable` whose message is the one line the UI shows.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx


class ServerUnavailable(Exception):
    """The server could not be reached or refused the request; str(e) is meant for the user."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text.strip()[:200] or resp.reason_phrase


def _refused(resp: httpx.Response, what: str) -> ServerUnavailable:
    if resp.status_code == 401:
        return ServerUnavailable(f"{what}: 401 unauthorized - wrong or missing API key "
                                 f"(--api-key or $STRATA_API_KEY)", 401)
    if resp.status_code == 404 and what == "/strata/slots":
        return ServerUnavailable("/strata/slots: 404 - this server is too old to report its slots", 404)
    return ServerUnavailable(f"{what}: {resp.status_code} {_error_message(resp)}", resp.status_code)


def _unreachable(base_url: str, e: httpx.HTTPError) -> ServerUnavailable:
    reason = str(e) or type(e).__name__
    return ServerUnavailable(f"cannot reach {base_url}: {reason}")


class ServerClient:
    """One httpx connection pool to one server (`base_url`, as `strata tui` was given it). Use inside
    `async with`."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 5.0):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Streams may pause for long prompt reads, so only connecting is bounded for them.
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                       timeout=httpx.Timeout(timeout_s, read=None))
        self._poll_timeout = timeout_s

    async def __aenter__(self) -> "ServerClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get_json(self, path: str) -> Any:
        try:
            resp = await self._http.get(path, timeout=self._poll_timeout)
        except httpx.HTTPError as e:
            raise _unreachable(self.base_url, e) from None
        if resp.status_code != 200:
            raise _refused(resp, path)
        try:
            return resp.json()
        except ValueError:
            raise ServerUnavailable(f"{path}: the answer is not JSON") from None

    async def slots(self) -> dict[str, Any]:
        """The `GET /strata/slots` document: model, one entry per engine slot, and engine totals."""
        doc = await self._get_json("/strata/slots")
        if not isinstance(doc, dict) or not isinstance(doc.get("slots"), list):
            raise ServerUnavailable("/strata/slots: unexpected document (no 'slots' list)")
        return doc

    async def model_name(self) -> str:
        doc = await self._get_json("/v1/models")
        try:
            return str(doc["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise ServerUnavailable("/v1/models: no model listed") from None

    async def stream_chat(self, messages: list[dict[str, str]], model: str,
                          options: dict[str, Any] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Yields `{"text": delta}` as the assistant's text arrives, then `{"usage": {...}}` if the server
        sends one. Closing the generator early closes the connection, which aborts the request on the
        server (it frees the slot when it sees the disconnect)."""
        body = {"model": model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **(options or {})}
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _refused(resp, "chat")
                async for line in resp.aiter_lines():
                    event = _parse_sse_line(line)
                    if event is None:
                        continue
                    if event == "[DONE]":
                        return
                    if "error" in event:
                        raise ServerUnavailable(f"chat: {event['error'].get('message', event['error'])}")
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            yield {"text": text}
                    if event.get("usage"):
                        yield {"usage": event["usage"]}
        except httpx.HTTPError as e:
            raise _unreachable(self.base_url, e) from None


def _parse_sse_line(line: str) -> Any:
    """The JSON of one `data:` line, the string "[DONE]", or None for blank lines and comments."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return payload
    try:
        return json.loads(payload)
    except ValueError:
        return None
