"""The natural batcher: two flushes in flight, results by position, failures per flush."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from dedupe.claims.batching import Batcher


class Flushes:
    """A flush that holds each call until the test lets it go."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gates: list[asyncio.Event] = []
        self.running = 0
        self.most = 0

    async def __call__(self, items: Sequence[int]) -> list[int]:
        gate = asyncio.Event()
        self.calls.append(list(items))
        self.gates.append(gate)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await gate.wait()
        finally:
            self.running -= 1
        if any(i < 0 for i in items):
            raise ValueError("refused")
        return [i * 10 for i in items]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_item_arriving_during_a_flush_goes_out_at_once_in_a_second() -> None:
    flush = Flushes()
    batcher: Batcher[int, int] = Batcher(flush)
    first = batcher.submit_nowait(1)
    await settle()
    second = batcher.submit_nowait(2)
    await settle()
    assert flush.calls == [[1], [2]]  # the second did not wait for the first to end
    third = batcher.submit_nowait(3)
    fourth = batcher.submit_nowait(4)
    await settle()
    assert len(flush.calls) == 2  # never more than two in flight
    flush.gates[1].set()  # the second ends first: results are placed by position
    await settle()
    assert second.done() and await second == [20]
    assert not first.done()
    assert flush.calls[2] == [3, 4]  # what queued meanwhile goes out together
    for gate in flush.gates:
        gate.set()
    await settle()
    for gate in flush.gates:
        gate.set()
    assert (await first, await third, await fourth) == ([10], [30], [40])
    assert flush.most == 2


async def test_a_group_split_over_flushes_that_end_out_of_order_keeps_its_order() -> None:
    flush = Flushes()
    batcher: Batcher[int, int] = Batcher(flush, max_batch=3)
    blocker = batcher.submit_nowait(0)
    await settle()
    many = asyncio.ensure_future(batcher.submit_many([1, 2, 3, 4, 5]))
    await settle()
    flush.gates[0].set()
    await settle()
    assert flush.calls[1:] == [[1, 2, 3], [4, 5]]
    flush.gates[2].set()  # the group's second part ends first
    await settle()
    assert not many.done()
    flush.gates[1].set()
    assert await many == [10, 20, 30, 40, 50]
    assert await blocker == [0]


async def test_a_failed_flush_fails_only_its_own_callers() -> None:
    flush = Flushes()
    batcher: Batcher[int, int] = Batcher(flush)
    bad = batcher.submit_nowait(-1)
    await settle()
    good = batcher.submit_nowait(7)
    await settle()
    for gate in flush.gates:
        gate.set()
    with pytest.raises(ValueError):
        await bad
    assert await good == [70]


async def test_one_in_flight_when_asked() -> None:
    flush = Flushes()
    batcher: Batcher[int, int] = Batcher(flush, in_flight=1)
    a = batcher.submit_nowait(1)
    await settle()
    b = batcher.submit_nowait(2)
    c = batcher.submit_nowait(3)
    await settle()
    assert flush.calls == [[1]]
    flush.gates[0].set()
    await settle()
    assert flush.calls == [[1], [2, 3]]
    flush.gates[1].set()
    assert (await a, await b, await c) == ([10], [20], [30])


async def test_idle_after_a_burst_then_new_work_is_flushed() -> None:
    flush = Flushes()
    batcher: Batcher[int, int] = Batcher(flush)
    first = batcher.submit_nowait(1)
    await settle()
    flush.gates[0].set()
    assert await first == [10]
    await settle()  # every worker has ended
    later = batcher.submit_nowait(2)
    await settle()
    flush.gates[1].set()
    assert await asyncio.wait_for(later, 1) == [20]


async def test_a_submission_no_flush_took_can_be_withdrawn_and_one_in_flight_cannot() -> None:
    flushes = Flushes()
    batcher: Batcher[int, int] = Batcher(flushes, in_flight=1)
    carried = batcher.submit([1])
    await settle()
    queued = batcher.submit([2])
    assert batcher.withdraw(queued) and queued.cancelled()
    assert not batcher.withdraw(carried)
    flushes.gates[0].set()
    assert await carried == [10]
    await settle()
    assert flushes.calls == [[1]]


async def test_a_cancelled_flush_cancels_its_callers_futures() -> None:
    """The loop ends under a flush: its callers' futures are cancelled, not left pending
    (a caller's give-back waiting on one would never end)."""
    flushes = Flushes()
    batcher: Batcher[int, int] = Batcher(flushes)
    future = batcher.submit([1])
    await settle()
    for task in list(batcher._tasks):
        task.cancel()
    await settle()
    assert future.cancelled()
