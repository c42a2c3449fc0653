"""What the cyclic GC finds: the tests that a run leaves no reference cycle of dedupe's objects
behind (tests/integration/test_*_garbage.py)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def saved_garbage() -> Iterator[list[Any]]:
    """What the cyclic GC finds unreachable from here to the block's end (kept, not freed):
    gc.garbage. Garbage made before is collected (and freed) first."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def ours(garbage: list[Any]) -> list[str]:
    """The objects of dedupe's own classes among the garbage."""
    return sorted(type(o).__qualname__ for o in garbage if type(o).__module__.startswith("dedupe."))
