"""`specstream serve`, flags and all, around an engine each of whose steps takes at least 20 ms,
so that a stream of N tokens without speculation lasts N / 50 seconds or more: long enough to send
SIGTERM, and a request after it, while it runs.
Usage: python tests/slow_step_server.py SERVE-FLAGS..."""

from __future__ import annotations

import sys
import time

from gateway.cli import main
from specstream import Engine

STEP_SECONDS = 0.02


def slow_down_steps() -> None:
    step = Engine.step

    def slow_step(self):
        time.sleep(STEP_SECONDS)
        return step(self)

    Engine.step = slow_step


if __name__ == "__main__":
    slow_down_steps()
    sys.exit(main(["serve", *sys.argv[1:]]))
