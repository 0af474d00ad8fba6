"""SuffixTree: csrc/suffix_tree.cpp's bounded-depth suffix tree over token sequences, loaded with ctypes.

The library is plain C++ with a C interface (no torch or Python headers), built with the C++ compiler on
first use into cache_dir()/kernels/<key>/ (the key covers the source and the compiler's command) in
about a second, and loaded in milliseconds after. Where it cannot be built (no compiler) `available()`
is False, says why once in the log, and suffix decoding is not offered.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

import numpy as np

from specstream.cache import cache_dir
from specstream.kernels.cpu import kept_library

log = logging.getLogger("specstream.kernels.suffix_tree")

SOURCE = Path(__file__).parent / "csrc" / "suffix_tree.cpp"
# Most draft tokens one speculate() call returns (the output buffers' size).
MAX_DRAFT = 256

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None

_i32p = ctypes.POINTER(ctypes.c_int32)
_f32p = ctypes.POINTER(ctypes.c_float)


def _command(out: Path) -> list[str]:
    return [os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC", str(SOURCE), "-o", str(out)]


def _build() -> Path:
    key = hashlib.sha256(repr(_command(Path("out.so"))).encode() + SOURCE.read_bytes()).hexdigest()[:20]
    return kept_library(cache_dir() / "kernels" / f"suffix-{key}" / "specstream_suffix_tree.so", _compile, "the suffix tree")


def _compile(out: Path) -> None:
    done = subprocess.run(_command(out), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the C++ build failed: {done.stderr.strip()[-2000:]}")


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                lib = ctypes.CDLL(str(_build()))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _error = f"{type(exc).__name__}: {exc}"
                log.warning("suffix decoding is unavailable (its suffix tree could not be built): %s", _error)
                return None
            lib.sst_new.argtypes, lib.sst_new.restype = [ctypes.c_int], ctypes.c_void_p
            lib.sst_delete.argtypes, lib.sst_delete.restype = [ctypes.c_void_p], None
            lib.sst_extend.argtypes, lib.sst_extend.restype = [ctypes.c_void_p, ctypes.c_int64, _i32p, ctypes.c_int], ctypes.c_int
            lib.sst_remove.argtypes, lib.sst_remove.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int
            lib.sst_seq_len.argtypes, lib.sst_seq_len.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64
            lib.sst_num_nodes.argtypes, lib.sst_num_nodes.restype = [ctypes.c_void_p], ctypes.c_int64
            lib.sst_source.argtypes, lib.sst_source.restype = [ctypes.c_void_p], ctypes.c_int64
            lib.sst_count.argtypes, lib.sst_count.restype = [ctypes.c_void_p, _i32p, ctypes.c_int], ctypes.c_int64
            lib.sst_speculate.argtypes = [
                ctypes.c_void_p, _i32p, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_int,
                _i32p, _i32p, _f32p, ctypes.POINTER(ctypes.c_int),
            ]
            lib.sst_speculate.restype = ctypes.c_int
            lib.sst_speculate_held.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_int,
                _i32p, _i32p, _f32p, ctypes.POINTER(ctypes.c_int),
            ]
            lib.sst_speculate_held.restype = ctypes.c_int
            _lib = lib
    return _lib


def available() -> bool:
    """Whether the suffix tree is built and loaded here (it is built on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    return _error


def _tokens(tokens) -> tuple[ctypes._Pointer, int]:
    """(a pointer to tokens as int32, how many): through a NumPy array, which the pointer keeps alive."""
    arr = np.ascontiguousarray(tokens, dtype=np.int32)
    return arr.ctypes.data_as(_i32p), len(arr)


class _Buffer:
    """A few tokens (a lookup's context, a step's new tokens) handed to the library through one kept ctypes array:
    filled by slice assignment, a few microseconds under converting them to a NumPy array and taking its pointer."""

    def __init__(self) -> None:
        self.array = (ctypes.c_int32 * MAX_DRAFT)()

    def fill(self, tokens) -> tuple[ctypes.Array | ctypes._Pointer, int]:
        """(what the library reads the tokens from, how many): the kept array, or where they do not fit in it
        (a prompt) or are not a list, a NumPy array's (_tokens)."""
        n = len(tokens)
        if n > MAX_DRAFT or not isinstance(tokens, list):
            return _tokens(tokens)
        self.array[:n] = tokens
        return self.array, n


class SuffixTree:
    """Counts of every substring of at most max_depth tokens of the sequences it holds (by integer id)."""

    def __init__(self, max_depth: int) -> None:
        lib = _load()
        if lib is None:
            raise RuntimeError(f"the suffix tree is unavailable: {_error}")
        if not 1 <= max_depth <= MAX_DRAFT:
            raise ValueError(f"max_depth must be between 1 and {MAX_DRAFT}")
        self._lib = lib
        self.max_depth = max_depth
        self._handle = lib.sst_new(max_depth)
        if not self._handle:
            raise MemoryError("could not create a suffix tree")
        self._out_tokens = (ctypes.c_int32 * MAX_DRAFT)()
        self._out_parents = (ctypes.c_int32 * MAX_DRAFT)()
        self._out_probs = (ctypes.c_float * MAX_DRAFT)()
        self._out_match = ctypes.c_int(0)
        self._in = _Buffer()

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.sst_delete(handle)

    def extend(self, seq_id: int, tokens) -> None:
        """Append tokens to sequence seq_id (created on first use)."""
        ptr, n = self._in.fill(tokens)
        if n and self._lib.sst_extend(self._handle, seq_id, ptr, n) != 0:
            self.remove(seq_id)
            raise MemoryError("the suffix tree ran out of memory")

    def remove(self, seq_id: int) -> bool:
        """Take sequence seq_id out (its substrings' counts go back down); whether it was held."""
        done = self._lib.sst_remove(self._handle, seq_id)
        if done < 0:
            raise MemoryError("the suffix tree ran out of memory while removing a sequence")
        return bool(done)

    def length(self, seq_id: int) -> int:
        """Tokens held for seq_id; -1 where it is not held."""
        return int(self._lib.sst_seq_len(self._handle, seq_id))

    @property
    def num_nodes(self) -> int:
        return int(self._lib.sst_num_nodes(self._handle))

    def source(self) -> int:
        """The held sequence (its id's low 31 bits) that last wrote the first token of the latest speculate,
        speculate_tree or speculate_held draft: the text that draft continues. -1 where that drafted nothing."""
        return int(self._lib.sst_source(self._handle))

    def count(self, tokens) -> int:
        """How often `tokens` occur in the held sequences (substrings up to max_depth long)."""
        return int(self._lib.sst_count(self._handle, *self._in.fill(tokens)))

    def speculate(
        self, context, max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> tuple[list[int], list[float], int]:
        """(draft tokens, each one's estimated chance of being how the text goes on, match length) for the
        context's last tokens: the best path over every match length, by the sum of its chances."""
        tokens, _, chances, match = self._speculate(context, max_tokens, max_spec_factor, min_token_prob, False)
        return tokens, chances, match

    def speculate_tree(
        self, context, max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> tuple[list[int], list[int], list[float], int]:
        """(tokens, parents, chances, match length): the best tree, grown best first, so that each token comes
        after its parent (parents[i]: an earlier index, or -1 for a token that follows the context)."""
        return self._speculate(context, max_tokens, max_spec_factor, min_token_prob, True)

    def speculate_held(
        self, seq_id: int, max_tokens: int, max_spec_factor: float, min_token_prob: float, tree: bool = False
    ) -> tuple[list[int], list[int], list[float], int]:
        """(tokens, parents, chances, match length) as speculate_tree (tree) or speculate (parents then all name
        the token before) give them for a context that is held sequence seq_id's own last tokens, without
        walking its suffixes from the root: a request's own tree, where every suffix of its text matches.
        Nothing where seq_id is not held."""
        n = self._lib.sst_speculate_held(
            self._handle, seq_id, min(max_tokens, MAX_DRAFT), max_spec_factor, min_token_prob, int(tree),
            self._out_tokens, self._out_parents, self._out_probs, ctypes.byref(self._out_match),
        )
        return self._drafted(n)

    def _speculate(self, context, max_tokens, factor, min_prob, tree):
        ctx = context[-self.max_depth :]
        n = self._lib.sst_speculate(
            self._handle, *self._in.fill(ctx), min(max_tokens, MAX_DRAFT), factor, min_prob, int(tree),
            self._out_tokens, self._out_parents, self._out_probs, ctypes.byref(self._out_match),
        )
        return self._drafted(n)

    def _drafted(self, n: int) -> tuple[list[int], list[int], list[float], int]:
        if n < 0:
            raise MemoryError("the suffix tree ran out of memory while speculating")
        return list(self._out_tokens[:n]), list(self._out_parents[:n]), list(self._out_probs[:n]), int(self._out_match.value)
