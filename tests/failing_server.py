"""`specstream serve`'s run loop around a real engine on the model directory argv[1] whose
step fails fatally once a request arrives: the server must exit non-zero on its own.
Usage: python tests/failing_server.py MODEL_DIR PORT"""

from __future__ import annotations

import sys

from gateway.cli import serve
from gateway.settings import GatewaySettings
from specstream import AsyncEngine, Engine, EngineConfig


def main(model_dir: str, port: int) -> int:
    inner = Engine(EngineConfig(model=model_dir, dtype="float32"))

    def fatal_step():
        raise RuntimeError("injected fatal fault")

    inner.step = fatal_step
    return serve(AsyncEngine(engine=inner), GatewaySettings(served_model_name="tiny"), host="127.0.0.1", port=port)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
