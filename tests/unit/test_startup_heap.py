"""Once started, a worker leaves its start-up objects out of later garbage collections."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from dedupe.worker import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_startup_heap_moves_what_is_alive_out_of_the_collections(unfrozen: None) -> None:
    kept = [[i] for i in range(1000)]  # lists: objects the collector tracks
    tracked = len(gc.get_objects())
    freeze_startup_heap()
    assert gc.get_freeze_count() >= len(kept)
    # A full collection now walks only what was made after the freeze.
    assert len(gc.get_objects()) < tracked / 2


def test_dedupe_worker_run_freezes_once_started() -> None:
    """Where cmd_run freezes; that a running worker has frozen is the process test's
    (tests/acceptance/test_worker_process.py)."""
    import inspect

    from dedupe.cli import run

    source = inspect.getsource(run.cmd_run)
    # After the worker is entered (its pools and app exist), before it waits.
    assert source.index("async with worker:") < source.index("freeze_startup_heap()")
    assert source.index("freeze_startup_heap()") < source.index("await worker.wait()")
