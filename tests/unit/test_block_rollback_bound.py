"""A `ctx.db.transaction()` block's ROLLBACK TO under a cancellation (dedupe.context._to_its_end):
it runs to its end before the cancellation goes on, but a statement that does not end (a
stalled connection) holds the run at most its bound, then the connection is closed. The
statement here is a coroutine that stands for one on a connection that answers, or never."""

from __future__ import annotations

import asyncio
import time

import pytest

from dedupe.context import _to_its_end


class Connection:
    def __init__(self) -> None:
        self.terminated = False

    def terminate(self) -> None:
        self.terminated = True


async def test_a_statement_that_ends_is_awaited_before_the_cancellation_goes_on() -> None:
    conn, ended = Connection(), asyncio.Event()

    async def rollback() -> str:
        await asyncio.sleep(0.2)
        ended.set()
        return "ROLLBACK"

    run = asyncio.ensure_future(_to_its_end(rollback(), conn, bound_s=5))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert ended.is_set()
    assert not conn.terminated


async def test_a_statement_that_never_ends_holds_a_cancelled_run_at_most_its_bound() -> None:
    conn = Connection()
    run = asyncio.ensure_future(_to_its_end(asyncio.sleep(3600), conn, bound_s=0.3))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    began = time.monotonic()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert 0.25 <= time.monotonic() - began < 2.0
    assert conn.terminated


async def test_without_a_cancellation_the_statement_has_no_bound_and_gives_its_result() -> None:
    conn = Connection()

    async def rollback() -> str:
        await asyncio.sleep(0.3)
        return "ROLLBACK"

    assert await _to_its_end(rollback(), conn, bound_s=0.1) == "ROLLBACK"  # type: ignore[arg-type]
    assert not conn.terminated
