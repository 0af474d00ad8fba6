"""Giving freed heap memory back to the operating system.

Start-up builds large temporary tensors (a GGUF file's blocks dequantized to float32 while the weights
are packed, a draft head's staging copies), and a step allocates activations that it frees at once.
torch's CPU allocator takes such memory from malloc, and glibc's malloc keeps what is freed in its
arenas (one per thread that allocated) for reuse: the process's resident memory stays at its peak long
after the tensors are gone. On the bundled model about 300 MiB of a server's resident set was such
freed memory after start-up.

release_free_heap() asks glibc to return it (malloc_trim(0), which trims every arena). The engine calls it
once start-up is built and whenever it goes idle after work; it takes milliseconds and frees nothing that
is in use. Elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("specstream.memory.heap")

_trim: object = False  # False: not looked up yet; None: unavailable


def _malloc_trim():
    global _trim
    if _trim is False:
        _trim = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _trim = fn
            except (OSError, AttributeError):  # musl and others have no malloc_trim
                log.debug("malloc_trim is unavailable: freed heap stays with the process")
    return _trim


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; whether anything could be asked to."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
