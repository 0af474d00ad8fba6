"""The built-in chat playground: one static page (HTML, JS, CSS shipped as package data in
gateway/static/, no build step, no CDN) served at ``/`` and ``/playground``.

The page is public and holds no secret: it talks to the same OpenAI endpoints as any client
(with the key the user types, kept in the browser's sessionStorage) and reads ``/metrics``.
Its one server-side helper, ``/playground/server.json``, says which speculation method the
server runs, so the page can offer exactly "that method" or "off".
"""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import APIError
from specstream import AsyncEngine

# The page loads only its own files and talks only to its own origin: even a rendering bug
# could not run injected inline script or send text elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
ASSETS = {
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}


def _read_static(name: str) -> bytes:
    return (files("gateway") / "static" / name).read_bytes()


def playground_routes(engine: AsyncEngine) -> list[Route]:
    """Routes for GET /, /playground, /playground/static/<asset> and /playground/server.json."""
    page = _read_static("playground.html")
    assets = {name: _read_static(name) for name in ASSETS}

    async def serve_page(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def serve_asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            raise APIError(404, f"no route GET {request.url.path}")
        return Response(assets[name], media_type=ASSETS[name], headers=SECURITY_HEADERS)

    async def server_info(request: Request) -> Response:
        return JSONResponse({"speculative_method": engine.speculative_method}, headers={"Cache-Control": "no-cache"})

    return [
        Route("/", serve_page, methods=["GET"]),
        Route("/playground", serve_page, methods=["GET"]),
        Route("/playground/static/{name}", serve_asset, methods=["GET"]),
        Route("/playground/server.json", server_info, methods=["GET"]),
    ]
