"""`specstream serve`'s run loop around an engine whose model takes a minute to load (the tiny model
at argv[1], behind a sleep): SIGTERM while it loads must still end the server at once.
Usage: python tests/slow_loading_server.py MODEL_DIR PORT"""

from __future__ import annotations

import sys
import time

from gateway.cli import serve
from gateway.settings import GatewaySettings
from specstream import AsyncEngine, EngineConfig
from specstream.engine import builder


def main(model_dir: str, port: int) -> int:
    build = builder.EngineBuilder.build

    def slow_build(self, log: bool = True):
        print("loading", flush=True)
        time.sleep(60)
        return build(self, log)

    builder.EngineBuilder.build = slow_build
    engine = AsyncEngine(EngineConfig(model=model_dir, dtype="float32"))
    return serve(engine, GatewaySettings(served_model_name="tiny"), host="127.0.0.1", port=port)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
