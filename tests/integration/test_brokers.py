"""Handler-level behaviour on both real brokers, one test body each: duplicates run once, bad
messages reach <channel>.dlq with their reason, a key in flight elsewhere comes back later."""

from __future__ import annotations

import asyncio
import json

import asyncpg
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.store import ClaimStore
from tests.conftest import eventually, running
from tests.integration.brokers import Broker


class Job(BaseModel):
    n: int


def app_for(channel: str, calls: list[str], *, delay_s: float = 0.0, **options: object) -> App:
    app = App("t")

    @app.handler(channel, **options)  # type: ignore[arg-type]
    async def work(payload: Job, ctx: Context) -> dict[str, int]:
        calls.append(ctx.key)
        await asyncio.sleep(delay_s)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        return {"n": payload.n}

    return app


def body(n: int) -> bytes:
    return json.dumps({"n": n}).encode()


async def _completed(worker: object) -> bool:
    return bool(worker.stats.completed)  # type: ignore[attr-defined]


async def _dead_lettered(worker: object) -> bool:
    return bool(sum(worker.stats.dead_lettered.values()))  # type: ignore[attr-defined]


async def test_duplicates_published_to_the_broker_run_once(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Every message published three times is handled once and every copy is settled."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    calls: list[str] = []
    messages = [(body(i), {}, f"k{i}") for i in range(60) for _ in range(3)]
    await broker.publish(channel, messages)
    async with running(app_for(channel, calls), store, broker.transport()) as worker:

        async def done() -> bool:
            return worker.stats.completed + worker.stats.duplicates >= 180

        await eventually(done)
    assert sorted(calls) == sorted(f"k{i}" for i in range(60))
    assert await db.fetchval("SELECT count(*) FROM effects") == 60
    assert await broker.backlog(channel) == 0


async def test_bad_messages_reach_the_dead_letter_queue_with_their_reason(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Conflict, invalid JSON, schema-invalid and missing key each land in <channel>.dlq."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    calls: list[str] = []
    # aiormq gives every published message a random message_id when the producer sets none,
    # so a key that can be missing is a header one.
    app = app_for(channel, calls, key="header:Idempotency-Key")

    def keyed(key: str) -> dict[str, str]:
        return {"Idempotency-Key": key}

    await broker.publish(channel, [(body(1), keyed("good"), "m1")])
    async with running(app, store, broker.transport()) as worker:
        await eventually(lambda: _completed(worker))
        await broker.publish(
            channel,
            [
                (body(2), keyed("good"), "m2"),  # same key, other payload
                (b"{not json", keyed("bad-json"), "m3"),
                (b'{"n": "three"}', keyed("bad-schema"), "m4"),
                (body(4), {}, "m5"),  # no key
            ],
        )

        async def dead() -> bool:
            return sum(worker.stats.dead_lettered.values()) >= 4

        await eventually(dead)
    letters = await broker.dead_letters(channel)
    reasons = {letter["message_id"]: letter["reason"] for letter in letters}
    assert reasons == {
        "m2": "key_conflict",
        "m3": "invalid_payload",
        "m4": "invalid_payload",
        "m5": "missing_key",
    }
    details = {letter["message_id"]: letter["detail"] for letter in letters}
    assert "n" in details["m4"]
    assert {
        (letter["scope"], letter["key"])
        for letter in letters
        if letter["message_id"] in {"m2", "m4"}
    } == {
        ("t.work", "good"),
        ("t.work", "bad-schema"),
    }
    assert calls == ["good"]
    # reading them leaves them where they are
    assert len(await broker.dead_letters(channel)) == 4
    assert await broker.backlog(channel) == 0


async def test_a_duplicate_of_a_key_in_flight_is_redelivered_later_and_then_acked(
    broker: Broker, channel: str, store: ClaimStore, db_url: str, db: asyncpg.Connection
) -> None:
    """The copy that finds the key in progress is deferred, comes back, and is acknowledged."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    calls: list[str] = []
    app = app_for(channel, calls, delay_s=1.0, lease_s=1.5)
    first, second = broker.transport(), broker.transport()
    async with (
        ClaimStore.open(db_url, owner="b") as other_store,
        running(app, store, first) as a,
        running(app, other_store, second) as b,
    ):
        await broker.ready(channel, first, second)
        # Two partitions on Kafka, so that the copies run side by side, as on two queues.
        await broker.publish(channel, [(body(1), {}, "k")], partition=0)
        await asyncio.sleep(0.3)
        await broker.publish(channel, [(body(1), {}, "k")], partition=1)

        async def settled() -> bool:
            return (
                a.stats.completed + b.stats.completed == 1
                and a.stats.duplicates + b.stats.duplicates == 1
            )

        await eventually(settled)
        assert a.stats.deferred + b.stats.deferred >= 1
    assert calls == ["k"]
    assert await broker.backlog(channel) == 0


async def test_replayed_dead_letters_run_again_once_released(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """dlq replay moves messages back and releases their failed claims: the handler runs
    again, once; nothing is left to replay."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    broken = [True]
    app = App("t")
    calls: list[str] = []

    @app.handler(channel, max_attempts=2, backoff_s=0.01, max_backoff_s=0.02)
    async def work(payload: Job, ctx: Context) -> None:
        calls.append(ctx.key)
        if broken[0]:
            raise ConnectionError("downstream is down")

    await broker.publish(channel, [(body(1), {}, "k")])
    async with running(app, store, broker.transport()) as worker:
        await eventually(lambda: _dead_lettered(worker))
        broken[0] = False
        released: list[str | None] = []

        async def release(scope: str, key: str) -> None:
            released.append(await store.release(scope, key))

        moved = await broker.replay(channel, release)
        assert [(m["scope"], m["key"], m["reason"]) for m in moved] == [
            ("t.work", "k", "max_attempts_exceeded")
        ]
        assert released == ["failed"]
        await eventually(lambda: _completed(worker))
    assert calls == ["k", "k", "k"]
    assert await broker.dead_letters(channel) == []
    assert await broker.replay(channel, release) == []
