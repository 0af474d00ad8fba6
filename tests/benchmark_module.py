"""A benchmark script (benchmarks/NAME.py) imported as a module, for the tests of its helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py as module NAME, registered in sys.modules (its dataclasses and NamedTuples look their
    module up there). The benchmarks' folder, which the script puts first on sys.path, is taken off again, so it
    shadows no test's imports."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module
