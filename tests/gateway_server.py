"""A real uvicorn server on loopback around create_app, for tests."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx
import uvicorn

from specstream import AsyncEngine, EngineConfig, RequestFailed, SpeculativeConfig


# Schemas the API tests hold replies to: a small object, and a weather tool's arguments.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def ngram_config(model_dir) -> EngineConfig:
    """The gateway tests' engine: the tiny model in float32, n-gram drafts of up to 4."""
    return EngineConfig(
        model=str(model_dir), dtype="float32", speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180, status: int = 200) -> None:
    """Wait until url's /health answers status (200: ready; 503: up, loading); fail if proc exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url}/health did not answer {status}")


def metric(url: str, prefix: str) -> float:
    """The sum of a metric's samples (prefix: the sample name, with its labels to pick one)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


class LiveServer:
    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class FaultInjectingEngine(AsyncEngine):
    """A real engine whose requests with "EXPLODE" in the prompt fail after three chunks, the
    way a request that hits an error while generating fails alone."""

    async def stream(self, prompt, params=None, request_id=None):
        chunks = super().stream(prompt, params, request_id)
        try:
            count = 0
            async for chunk in chunks:
                count += 1
                if "EXPLODE" in str(prompt) and count > 3:
                    raise RequestFailed(f"request {request_id} failed: RuntimeError('boom')")
                yield chunk
        finally:
            await chunks.aclose()
