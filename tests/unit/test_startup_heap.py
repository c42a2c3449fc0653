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
