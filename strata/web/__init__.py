"""The web page of `strata serve`: `mount_webui(app)` serves it at `/` and its files under `/static/`.

The page is plain HTML, CSS and JavaScript in `static/` (no build step, nothing loaded from elsewhere).
It talks to the server only through the public API (`/v1/models`, `/v1/chat/completions`, `/strata/slots`),
sending the API key the user typed, so the files themselves are served without authentication.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"

# The page builds its HTML from escaped text only; the policy makes sure nothing else could run or load.
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
}


def mount_webui(app) -> None:
    """Adds `GET /` (the page) and `/static/*` (its files) to the FastAPI `app`."""
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    index = STATIC_DIR / "index.html"

    async def page() -> FileResponse:
        return FileResponse(index, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    app.add_api_route("/", page, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
