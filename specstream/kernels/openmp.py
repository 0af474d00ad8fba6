"""OpenMP's thread pools, in which torch's CPU kernels (and ours, csrc/) run their parallel regions.

libgomp, torch's OpenMP runtime on Linux, keeps one pool of worker threads for every thread that has
run a parallel region, and the pools live as long as their threads. While all pools together hold more
threads than the process has CPUs, libgomp stops spin-waiting between regions: each region then wakes
its workers through the kernel. A decode step of a small model runs about two hundred short regions,
so a second pool can make it about twice as slow (tests/test_async_engine.py checks that start frees
the idle pool).

AsyncEngine runs the engine in a thread of its own; when the thread that starts it has already run
torch work (loaded a model, multiplied two matrices), release_idle_pool() frees that thread's idle
pool, which libgomp does for omp_pause_resource_all. The thread gets a new pool if it runs a parallel
region again.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger("specstream.kernels.openmp")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings

_lib: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None: not Linux, another OpenMP
    runtime, or one without OpenMP 5.0's pause."""
    global _lib
    if _lib is not False:
        return _lib
    _lib = None
    if sys.platform != "linux":
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        _lib = lib
        break
    return _lib


def release_idle_pool() -> bool:
    """Free the calling thread's idle OpenMP worker threads (none if it never ran a parallel region).
    True when the runtime did (or had nothing to free); False where this runtime cannot."""
    lib = _libgomp()
    if lib is None:
        return False
    done = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not done:
        log.debug("OpenMP refused to pause (called inside a parallel region?)")
    return done
