"""Graceful drain: on SIGTERM `specstream serve` stops admitting (/health and new requests answer 503,
with Retry-After), lets the streams in flight finish within --shutdown-timeout, then exits 0; a
Kubernetes rolling update or scale-down never cuts a stream."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.cli import main
from gateway.drain import MAX_SHUTDOWN_TIMEOUT, Drain, DrainMiddleware
from gateway_server import free_port, wait_healthy
from test_serve_exit import start

MODEL = "tiny"


class Stream(threading.Thread):
    """One streamed chat completion of max_tokens tokens, read line by line as it arrives."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.lines: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count on and on."}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
        except httpx.HTTPError as exc:  # a cut stream: the test says so
            self.error = exc

    def wait_for_content(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any('"content"' in line for line in self.lines):
            assert time.monotonic() < deadline and self.is_alive(), f"no content streamed: {self.lines} {self.error}"
            time.sleep(0.01)

    def usage(self) -> dict:
        chunks = [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]
        return chunks[-1]["usage"]


def serve(model_dir, port: int, *flags: str):
    # No speculation: one token per (slowed, 20 ms) step, so the stream's length is its duration.
    common = ["--model", str(model_dir), "--served-model-name", MODEL, "--port", str(port)]
    return start("slow_step_server.py", *common, "--speculative-method", "off", *flags)


def end(proc, timeout: float) -> str:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return stderr


def test_sigterm_lets_the_stream_in_flight_finish_refuses_new_requests_and_exits_0(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(tiny_model_dir, port, "--shutdown-timeout", "60")
    try:
        wait_healthy(url, proc, timeout=180)
        stream = Stream(url, max_tokens=150)  # 3 s at least
        stream.start()
        stream.wait_for_content()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "/health still answers 200 after SIGTERM"
            time.sleep(0.02)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        late = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=10,
        )
        assert stream.is_alive(), "the stream ended before the late request was refused: make it longer"
        stream.join(120)
    finally:
        stderr = end(proc, timeout=60)
    assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
    assert late.json()["error"]["code"] == "server_draining"
    assert set(late.json()["error"]) == {"message", "type", "param", "code"}
    assert stream.status == 200 and stream.error is None
    assert stream.lines[-1] == "data: [DONE]" and stream.usage()["completion_tokens"] == 150
    assert proc.returncode == 0, stderr[-3000:]
    assert "draining 1 request(s) in flight" in stderr and "Application shutdown complete" in stderr


def test_a_stream_longer_than_the_shutdown_timeout_is_cut_and_the_server_still_exits_0(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(tiny_model_dir, port, "--shutdown-timeout", "1")
    try:
        wait_healthy(url, proc, timeout=180)
        stream = Stream(url, max_tokens=900)  # 18 s at least
        stream.start()
        stream.wait_for_content()
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stderr = end(proc, timeout=30)
        stopped = time.monotonic() - signalled
        stream.join(30)
    finally:
        if proc.poll() is None:
            end(proc, timeout=5)
    assert proc.returncode == 0, stderr[-3000:]
    assert stopped < 10, f"took {stopped:.1f} s to stop with a 1 s shutdown timeout"
    assert "cutting 1 request(s) still in flight" in stderr
    assert "data: [DONE]" not in stream.lines


def test_sigterm_with_nothing_in_flight_exits_0_at_once(tiny_model_dir):
    port = free_port()
    proc = serve(tiny_model_dir, port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=180)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stderr = end(proc, timeout=30)
    finally:
        if proc.poll() is None:
            end(proc, timeout=5)
    assert proc.returncode == 0, stderr[-3000:]
    assert time.monotonic() - signalled < 10 and "drained: no request in flight" in stderr


@pytest.mark.parametrize("value", ["-1", "nan", "inf", str(MAX_SHUTDOWN_TIMEOUT + 1)])
def test_a_shutdown_timeout_out_of_bounds_is_refused_before_anything_loads(value, capsys):
    assert main(["serve", "--model", "unused", "--port", str(free_port()), "--shutdown-timeout", value]) == 2
    assert "shutdown timeout must be within 0..3600 seconds" in capsys.readouterr().err


async def test_while_draining_health_and_requests_get_503_but_metrics_are_served():
    async def ok(request):
        return JSONResponse({"ok": True})

    drain = Drain()
    paths = ("/health", "/metrics", "/v1/chat/completions", "/v1/messages")
    routes = [Route(path, ok, methods=["GET", "POST"]) for path in paths]
    app = DrainMiddleware(Starlette(routes=routes), drain, retry_after_seconds=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 200
        drain.begin()
        health = await c.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = await c.post("/v1/chat/completions", json={})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        assert refused.headers["connection"] == "close"
        assert refused.json()["error"]["type"] == "service_unavailable"
        anthropic = await c.post("/v1/messages", json={})
        assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "overloaded_error"
        assert (await c.get("/metrics")).status_code == 200
    assert drain.in_flight == 0
