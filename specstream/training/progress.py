"""Time budget and progress lines for the trainer's long phases."""

from __future__ import annotations

import logging
import math
import time

logger = logging.getLogger("specstream.training")


class Clock:
    def __init__(self, minutes: float, spent: float = 0.0) -> None:
        self.start = time.perf_counter() - spent
        self.budget = minutes * 60.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def left(self) -> float:
        return self.budget - self.elapsed


def progress(label: str, done: float, total: float, started: float, unit: str) -> None:
    spent = time.perf_counter() - started
    rate = done / spent if spent > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else float("inf")
    pct = 100.0 * done / total if total else 100.0
    logger.info("%s: %.0f/%.0f %s (%.0f%%), %.0f %s/s, ETA %s", label, done, total, unit, pct, rate, unit, fmt_duration(eta))


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
