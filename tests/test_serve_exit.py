"""`specstream serve` exits non-zero, with the reason on stderr, when its model fails to
load and when its engine fails fatally later, so a supervisor restarts it instead of
leaving it answering 503 forever."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gateway_server import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


def start(script: str, *args: str) -> subprocess.Popen:
    """python tests/SCRIPT ARGS, its output piped."""
    cmd = [sys.executable, str(ROOT / "tests" / script), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients")])}
    return env


def test_a_model_that_fails_to_load_exits_non_zero_with_the_message():
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", "nosuch/model", "--port", str(free_port())]
    done = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "could not load 'nosuch/model'" in done.stderr and "error: the engine failed, exiting" in done.stderr


def test_a_fatal_engine_error_after_start_exits_non_zero(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start("failing_server.py", str(tiny_model_dir), str(port))
    try:
        wait_healthy(url, proc, timeout=120)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr[-2000:]
    assert "injected fatal fault" in stderr and "error: the engine failed, exiting" in stderr


def test_a_port_in_use_exits_at_once_with_the_reason(tiny_model_dir):
    """The port is bound before anything loads: a taken one ends the server within seconds."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port)]
        start = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"error: cannot listen on 127.0.0.1:{port}" in done.stderr and "in use" in done.stderr
    assert "loading" not in done.stderr  # nothing was loaded
    assert time.monotonic() - start < 30


def test_sigterm_while_the_model_loads_ends_the_server():
    port = free_port()
    proc = start("slow_loading_server.py", "unused-model-dir", str(port))
    try:
        assert proc.stdout.readline().strip() == "loading"  # the engine thread is inside the (slow) load
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=30, status=503)  # up, answering "loading"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)  # the load had 50 s to go: nothing waits for it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # Nothing is in flight while loading, so the drain ends at once and the server exits 0.
    assert proc.returncode == 0, stderr[-2000:]
    assert "Application shutdown complete" in stderr
