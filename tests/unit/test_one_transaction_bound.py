"""The bound of a one-transaction HTTP run (OneTransactionRun._endpoint), without a database:
the endpoint runs in the request's own task, a timer cancels it past the bound while its answer
is being buffered, and that cancellation is told from anyone else's by the task's count of
cancellations asked, whatever that count was before."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from dedupe.asgi.one_transaction import OneTransactionRun
from dedupe.asgi.run import Held
from dedupe.claims.database import TransactionBounds
from dedupe.claims.records import Fence

FENCE = Fence("t.http", "k", 1)


class Boom(BaseException):
    """Neither an Exception nor a cancellation."""


def run_of(
    app: Any, *, run_s: float = 0.05, kind: type[OneTransactionRun] = OneTransactionRun
) -> OneTransactionRun:
    run = kind(
        app=app,
        store=None,  # type: ignore[arg-type]
        leases=None,  # type: ignore[arg-type]
        fence=FENCE,
        attempt=1,
        retention_s=60.0,
        max_response_bytes=1024,
        db=None,  # type: ignore[arg-type]
        send=None,  # type: ignore[arg-type]
        bounds=TransactionBounds.of(30.0, run_s),
    )
    run._held = Held(FENCE, run_s)
    return run


async def sleeps(scope: Any, receive: Any, send: Any) -> None:
    await asyncio.sleep(5)


async def swallows(scope: Any, receive: Any, send: Any) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(5)


async def turns_it_into_boom(scope: Any, receive: Any, send: Any) -> None:
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        raise Boom() from None


async def in_task(run: OneTransactionRun, *, cancelled_before: bool = False) -> Any:
    """run._endpoint in a task of its own; (its result or exception, its cancelling count)."""

    async def body() -> Any:
        task = asyncio.current_task()
        assert task is not None
        if cancelled_before:  # an outer cancel caught without uncancel() (anyio 3 scopes...)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
            assert task.cancelling() == 1
        try:
            result: Any = await run._endpoint({}, None)  # type: ignore[arg-type]
        except BaseException as exc:
            result = exc
        return result, task.cancelling()

    return await asyncio.wait_for(asyncio.create_task(body()), 5)


@pytest.mark.parametrize("cancelled_before", [False, True])
async def test_the_bound_cuts_the_endpoint_off_whatever_the_tasks_count_was(
    cancelled_before: bool,
) -> None:
    run = run_of(sleeps)
    result, cancelling = await in_task(run, cancelled_before=cancelled_before)
    assert result == (True, None)
    assert run._cut
    assert cancelling == (1 if cancelled_before else 0)  # ours taken back, no more


async def test_an_endpoint_that_swallows_the_cut_is_cut_off_all_the_same() -> None:
    run = run_of(swallows)
    result, cancelling = await in_task(run)
    assert result == (False, None)
    assert run._cut  # _cut_off answers the 503 for it
    assert cancelling == 0


async def test_a_base_exception_after_the_cut_is_returned_for_the_run_to_settle() -> None:
    run = run_of(turns_it_into_boom)
    (cancelled, error), cancelling = await in_task(run)
    assert not cancelled and isinstance(error, Boom)
    assert cancelling == 0


class CancelledAtTheBound(OneTransactionRun):
    """The server cancels the request in the same turn of the loop as the bound cuts it off."""

    def _expire(self, task: asyncio.Task[Any]) -> None:
        super()._expire(task)
        task.cancel()


async def test_a_cancellation_not_ours_goes_on_even_when_the_bound_also_fired() -> None:
    run = run_of(sleeps, kind=CancelledAtTheBound)
    result, cancelling = await in_task(run)
    assert run._cut
    assert isinstance(result, asyncio.CancelledError)  # the server's goes on
    assert cancelling == 1  # ours taken back, the server's left


async def test_no_cut_once_the_answer_is_being_committed() -> None:
    run = run_of(sleeps, run_s=0.05)
    assert run._held is not None
    run._held.completing = True  # as _commit sets it before its first await

    async def quick(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.15)  # past the bound

    run.app = quick
    result, _ = await in_task(run)
    assert result == (False, None)
    assert not run._cut
