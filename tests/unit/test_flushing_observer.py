"""A flushing observer's stop lets the flush under way finish, then flushes once more."""

from __future__ import annotations

import asyncio

from dedupe.pipeline.observers import FlushingObserver


class Slow(FlushingObserver):
    interval_s = 0.01

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.finished = 0
        self.calls = 0

    async def flush(self) -> None:
        self.calls += 1
        self.started.set()
        await asyncio.sleep(0.2)
        self.finished += 1


async def test_a_stop_does_not_cut_a_flush_short_and_flushes_once_more() -> None:
    """Before, the stop cancelled the background flush mid-write: what it had taken from the
    buffers was lost (a duplicate's span ended without its original trace)."""
    observer = Slow()
    async with observer:
        await asyncio.wait_for(observer.started.wait(), 5)
    assert observer.finished == observer.calls >= 1


async def test_a_flush_that_hangs_is_cancelled_after_the_stop_timeout() -> None:
    observer = Slow()
    observer.stop_timeout_s = 0.05

    async def hang() -> None:
        observer.started.set()
        await asyncio.sleep(60)

    observer.flush = hang  # type: ignore[method-assign]
    async with observer:
        await asyncio.wait_for(observer.started.wait(), 5)
    assert observer._task is None
