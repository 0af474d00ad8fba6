"""The SDK installs on its own, as the README says (`pip install ./clients` in a fresh
virtualenv), with httpx as its only heavy dependency: no torch, no engine, no server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# httpx and what it pulls in; nothing else may arrive with the SDK.
ALLOWED = {
    "specstream-client",
    "httpx",
    "httpcore",
    "h11",
    "anyio",
    "idna",
    "certifi",
    "sniffio",
    "typing-extensions",
    "typing_extensions",
    "exceptiongroup",
    "pip",
    "setuptools",
}
UNREACHABLE = (
    "No matching distribution",
    "Could not find a version",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Failed to establish a new connection",
    "ProxyError",
)

CHECK = """
import importlib.metadata as md, json, sys
import httpx
import specstream_client
from specstream_client import Client

def handler(request):
    return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "created": 1, "owned_by": "x"}]})

with Client("http://t/v1", transport=httpx.MockTransport(handler)) as c:
    models = [m.id for m in c.models.list()]
heavy = sorted(m for m in ("torch", "numpy", "specstream", "gateway", "transformers") if m in sys.modules)
print(json.dumps({"models": models, "heavy": heavy, "dists": sorted(d.metadata["Name"] for d in md.distributions())}))
"""


def test_the_sdk_installs_in_a_fresh_venv_without_torch(tmp_path):
    venv = tmp_path / "sdkvenv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # --without-pip and the running pip aimed at the new venv (pip --python) save ensurepip's
    # time; the install itself is the README's `pip install ./clients`.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--disable-pip-version-check",
            "--quiet",
            str(ROOT / "clients"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    if install.returncode != 0 and any(marker in install.stderr for marker in UNREACHABLE):
        pytest.skip(f"pip could not reach a package index to fetch httpx and setuptools: {install.stderr[-300:]}")
    assert install.returncode == 0, install.stderr[-3000:]
    # Run outside the checkout so that only the installed copy can be imported.
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    report = json.loads(done.stdout)
    assert report["models"] == ["m"] and report["heavy"] == []
    assert set(report["dists"]) <= ALLOWED, set(report["dists"]) - ALLOWED
