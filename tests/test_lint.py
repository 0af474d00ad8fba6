"""Lint and types are part of the test run (CI runs `make test`): ruff over the whole tree
with the rules in pyproject.toml, the formatter over the serving layer and the SDK, and mypy
over the SDK, which ships py.typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATTED = ["gateway", "clients"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_serving_layer_and_sdk_are_ruff_formatted():
    done = run("ruff", "format", "--check", *FORMATTED)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_sdk_type_checks():
    done = run("mypy", "clients/specstream_client")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
