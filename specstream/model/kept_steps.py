"""Functions compiled ahead of time for the lean forward's short steps, kept on disk between starts:
what their guards may carry, how their files age out, and helpers for the log (fast_llama.py builds,
loads and calls them).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

def mark_dynamic(x, cos, sin, slot_mapping, kv_index, mask, q_index, out_index) -> None:
    """Tell the tracer which sizes vary from step to step: rows, sequences, query run, context. A size
    of 1 is left unmarked: the tracer specializes it anyway, and a function kept on disk records it as
    unmarked, so a marked one would fail its guards when loaded."""

    def mark(t: torch.Tensor, dim: int) -> None:
        if t.shape[dim] != 1:
            torch._dynamo.maybe_mark_dynamic(t, dim)

    for t in (x, cos, sin, slot_mapping, out_index):
        mark(t, 0)
    for dim in (0, 1):
        mark(kv_index, dim)
        mark(q_index, dim)
    if mask is not None:
        for dim in (0, 2, 3):
            mark(mask, dim)


# A kept function no start has loaded for this long is deleted when another is saved (a new version
# of the code, or a configuration no longer served, leaves its files behind).
KEPT_UNUSED_DAYS = 30


def prune(directory: Path) -> None:
    cutoff = time.time() - KEPT_UNUSED_DAYS * 86400
    for old in directory.glob("*.bin"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another process pruned it first
            pass


# The guards on the layers' arguments that saveable_guards drops (see there).
_LAYER_GUARDS = ("TENSOR_MATCH", "SEQUENCE_LENGTH", "CONSTANT_MATCH")


def saveable_guards(guards) -> list[bool]:
    """Guards a compiled function kept on disk can carry: those on object identity (ID_MATCH and the
    like) cannot be saved. What they protect (this module's code, the functions it calls) is in the
    file's key instead (fast_llama._kept_key); shapes, dtypes and constants stay guarded.

    The guards on the layers' arguments are dropped too (_LAYER_GUARDS: each weight's and pool tensor's
    match, each kernel tuple's length and constants): a step passes the same layers every time, and their
    shapes, dtypes, lengths and constants are in the key. Checked each step, after a forward has pushed
    them out of the caches, they cost a visible share of a decode step. The step's own tensors (rows,
    indexes, mask) and every size relation (the shape environment's guard) stay checked."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        g.guard_type not in unsaved
        and not unsaved.intersection(g.derived_guard_types or ())
        and not (g.guard_type in _LAYER_GUARDS and g.name.startswith("layers["))
        for g in guards
    ]


def signature(obj):
    """Shapes and dtypes in place of tensors, recursively: what a key may depend on."""
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), str(obj.dtype))
    if isinstance(obj, (tuple, list)):
        return tuple(signature(o) for o in obj)
    return obj


def guard_failure(fn, args: tuple) -> str:
    """The first guard of fn that args fail, for the log (torch's internals: best effort)."""
    try:
        info = fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(*args))
        return str(info)[:600]
    except Exception:  # noqa: BLE001
        return "a guard failed"
