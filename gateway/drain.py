"""Graceful drain: on SIGTERM (or SIGINT) the server stops admitting, lets the requests in flight
finish, then exits 0, so a rolling update or a scale-down in Kubernetes never cuts a stream.

- `Drain` counts the HTTP requests in flight and records when draining began.
- `DrainMiddleware` (installed by create_app) counts each admitted request until its response,
  streamed or not, has been sent; while draining it answers /health with 503
  {"status": "draining"} and every other request but /metrics with 503 and Retry-After, in OpenAI's
  error shape (Anthropic's on its paths), so a load balancer or router sends it to another replica.
- `DrainingServer` (uvicorn's Server, as `specstream serve` runs it) turns the first SIGTERM or
  SIGINT into a drain instead of uvicorn's immediate shutdown, and shuts down once nothing is in
  flight or `shutdown_timeout` seconds have passed (what is still running then is cut). A second
  signal is uvicorn's own: shut down now.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

log = logging.getLogger("specstream.gateway")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
MAX_SHUTDOWN_TIMEOUT = 3600.0
# Paths served while draining: the Prometheus scrape (routers and autoscalers still read the pod).
SERVED_WHILE_DRAINING = ("/metrics",)


def check_shutdown_timeout(seconds: float) -> float:
    if not 0 <= seconds <= MAX_SHUTDOWN_TIMEOUT:  # also refuses NaN
        raise ValueError(f"the shutdown timeout must be within 0..{MAX_SHUTDOWN_TIMEOUT:g} seconds, got {seconds}")
    return seconds


class Drain:
    """Requests in flight, and whether (since when) the server is draining."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.since: float | None = None  # time.monotonic() when draining began

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain, retry_after_seconds: int = 1) -> None:
        self.app, self.drain, self.retry_after = app, drain, str(retry_after_seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in SERVED_WHILE_DRAINING:
            await self.refusal(scope["path"])(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1

    def refusal(self, path: str):
        headers = {"Retry-After": self.retry_after, "Connection": "close"}
        if path == "/health":
            return JSONResponse({"status": "draining"}, status_code=503, headers=headers)
        message = "the server is shutting down; retry on another replica"
        return APIError(503, message, code="server_draining", headers=headers).response_for(path)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose first SIGTERM or SIGINT drains (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.drain, self.shutdown_timeout = drain, check_shutdown_timeout(shutdown_timeout)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: uvicorn's shutdown, now
            return
        self.drain.begin()
        log.info(
            "%s: draining %d request(s) in flight for up to %gs; new requests get 503",
            signal.Signals(sig).name,
            self.drain.in_flight,
            self.shutdown_timeout,
        )

    async def on_tick(self, counter: int) -> bool:
        drain = self.drain
        if drain.since is not None and not self.should_exit:
            if drain.in_flight == 0:
                log.info("drained: no request in flight; shutting down")
                self.should_exit = True
            elif time.monotonic() - drain.since >= self.shutdown_timeout:
                log.warning("shutdown timeout: cutting %d request(s) still in flight", drain.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)
