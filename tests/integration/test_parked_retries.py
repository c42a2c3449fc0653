"""Delays that hold nothing (DESIGN §4.8): a retry whose delay or backoff is at least
`park_after_s` goes through the broker. The failed attempt stays counted, the key is given back
(no lease, no slot, no sleeping task while it waits) and the message is deferred: a RabbitMQ
delay queue or Kafka's deferral carries it. Before, the worker slept with the lease held."""

from __future__ import annotations

import time

import asyncpg

from dedupe import App, Context, Retry
from dedupe.claims.store import ClaimStore
from dedupe.testing import TestRun
from tests.conftest import ADMIN_URL, eventually, running
from tests.integration.brokers import Broker


def retrying_app(channel: str, runs: list[int], *, delay_s: float, fail_runs: int) -> App:
    app = App("t")

    @app.handler(channel, lease_s=10.0, max_attempts=3)
    async def flaky(payload: dict[str, int], ctx: Context) -> dict[str, int]:
        runs.append(ctx.attempt)
        if len(runs) <= fail_runs:
            raise Retry("not yet", delay_s=delay_s)
        return {"attempt": ctx.attempt}

    return app


async def claim_row(db: asyncpg.Connection) -> asyncpg.Record | None:
    return await db.fetchrow(
        "SELECT status, attempts, error, lease_until > now() AS lease_live, reason"
        " FROM dedupe_claims WHERE scope = 't.flaky' AND key = 'm-1'"
    )


async def test_a_long_retry_delay_gives_the_key_back_and_waits_in_the_broker(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    runs: list[int] = []
    app = retrying_app(channel, runs, delay_s=1.5, fail_runs=1)
    transport = broker.transport()
    async with running(app, store, transport, park_after_s=0.5):
        await broker.ready(channel, transport)
        await broker.publish(channel, [(b'{"n": 1}', {}, "m-1")])

        async def parked() -> asyncpg.Record | None:
            row = await claim_row(db)
            if runs and row is not None and row["status"] == "in_progress":
                return row if not row["lease_live"] else None
            return None

        # While the retry waits, the claim holds no live lease and its attempt stays counted.
        row = await eventually(parked, timeout_s=5, interval_s=0.02)
        assert (row["attempts"], row["error"]) == (1, "handed back")

        async def done() -> asyncpg.Record | None:
            row = await claim_row(db)
            return row if row is not None and row["status"] == "completed" else None

        row = await eventually(done, timeout_s=20)
    assert runs == [1, 2]
    assert row["attempts"] == 2


async def test_parked_retries_count_every_attempt_and_dead_letter_after_max_attempts(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    runs: list[int] = []
    app = retrying_app(channel, runs, delay_s=0.6, fail_runs=99)
    transport = broker.transport()
    async with running(app, store, transport, park_after_s=0.5):
        await broker.ready(channel, transport)
        await broker.publish(channel, [(b'{"n": 1}', {}, "m-1")])

        async def failed() -> asyncpg.Record | None:
            row = await claim_row(db)
            return row if row is not None and row["status"] == "failed" else None

        row = await eventually(failed, timeout_s=30)
        letters = await eventually(lambda: broker.dead_letters(channel), timeout_s=15)
    assert runs == [1, 2, 3]
    assert (row["attempts"], row["reason"]) == (3, "max_attempts_exceeded")
    assert [letter["reason"] for letter in letters] == ["max_attempts_exceeded"]


async def test_the_backoff_keeps_growing_across_parked_retries_and_holds_no_worker() -> None:
    """A backoff past park_after_s (here 20 s) is parked; the in-memory broker brings it back
    at once (max_delay_s), so three runs take well under one backoff. Before, the worker slept."""
    runs: list[int] = []
    app = App("kit")

    @app.handler("jobs", key="header:Idempotency-Key", backoff_s=20.0, max_attempts=3)
    async def flaky(payload: dict[str, int], ctx: Context) -> int:
        runs.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError("the provider is down")
        return ctx.attempt

    began = time.monotonic()
    async with TestRun(app, database_url=ADMIN_URL) as run:
        run.publish("jobs", {"n": 1}, headers={"idempotency-key": "k-1"})
        await run.idle(timeout_s=10)
        assert await run.result("k-1") == 3
        [claim] = await run.claims()
        assert (claim.status, claim.attempts) == ("completed", 3)
    assert runs == [1, 2, 3]
    assert time.monotonic() - began < 10
