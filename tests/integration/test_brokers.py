"""Handler-level behaviour on both real brokers, one test body each: duplicates run once, bad
messages reach <channel>.dlq with their reason, a key in flight elsewhere comes back later,
replay releases only failed claims, zombies are fenced, crash loops end in the DLQ."""

from __future__ import annotations

import asyncio
import hashlib
import json

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context, Reject
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.claims.store import ClaimStore
from dedupe.observability.logs import fields_of
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
    # The run outlasts the second copy's publish (a new producer on Kafka) by far, so the copy
    # meets the live claim even on a loaded machine.
    app = app_for(channel, calls, delay_s=3.0, lease_s=4.5)
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


async def test_replaying_dead_letters_releases_only_claims_that_failed(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A key_conflict dead letter names the OTHER payload's claim, which may be running: replay
    leaves it alone. A failed claim is released, but only while it is still 'failed'."""
    app = App("t")

    @app.handler(channel)
    async def work(payload: Job, ctx: Context) -> None:
        raise Reject("not for us")

    # Someone else runs "busy" with another payload, under a live lease.
    [busy] = await store.claim_batch(
        [ClaimRequest("t.work", "busy", hashlib.sha256(body(1)).digest())],
        lease_s=600,
        retention_s=3600,
    )
    assert busy.owned
    await broker.publish(
        channel, [(body(2), {}, "busy"), (body(3), {}, "broken"), (body(4), {}, "again")]
    )
    async with running(app, store, broker.transport()) as worker:

        async def dead() -> bool:
            return sum(worker.stats.dead_lettered.values()) == 3

        await eventually(dead)
    # "again" was released meanwhile and is running somewhere (a replay that ran twice).
    await store.release("t.work", "again")
    [again] = await store.claim_batch(
        [ClaimRequest("t.work", "again", hashlib.sha256(body(4)).digest())],
        lease_s=600,
        retention_s=3600,
    )
    assert again.owned
    claims = "SELECT key, status, token, lease_until, retryable FROM dedupe_claims ORDER BY key"
    before = {row["key"]: dict(row) for row in await db.fetch(claims)}
    offered: list[str] = []
    released: list[bool] = []

    async def release(scope: str, key: str) -> None:
        offered.append(key)
        released.append(await store.release_failed(scope, key))

    moved = await broker.replay(channel, release)
    assert sorted((m["key"], m["reason"]) for m in moved) == [
        ("again", "rejected"),
        ("broken", "rejected"),
        ("busy", "key_conflict"),
    ]
    assert sorted(offered) == ["again", "broken"]  # never the conflict's claim
    assert released == [key == "broken" for key in offered]
    after = {row["key"]: dict(row) for row in await db.fetch(claims)}
    assert after["busy"] == before["busy"]  # its lease is intact: nobody can take it over
    assert after["again"] == before["again"]
    assert (before["broken"]["retryable"], after["broken"]["retryable"]) == (False, True)


async def test_dead_letter_log_lines_carry_the_message_fields(
    broker: Broker,
    channel: str,
    store: ClaimStore,
    db: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The transport's "dead-lettered" line names the scope, key, message id and reason."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    calls: list[str] = []
    await broker.publish(channel, [(b'{"n": "one"}', {}, "m1")])
    async with running(app_for(channel, calls), store, broker.transport()) as worker:
        await eventually(lambda: _dead_lettered(worker))
        await asyncio.sleep(0.1)
    [line] = [
        r
        for r in caplog.records
        if r.name.startswith(("dedupe_rabbitmq.", "dedupe_kafka."))
        and "dead-lettered" in r.getMessage()
    ]
    assert fields_of(line) == {
        "scope": "t.work",
        "key": "m1",
        "message_id": "m1",
        "outcome": "dead_letter",
        "reason": "invalid_payload",
        "channel": channel,
    }


# -- the claim protocol's guarantees, on each broker ----------------------------------------


def pinned(i: int) -> int:
    """A Kafka partition per index, so that copies of one key run side by side (RabbitMQ has
    one queue and ignores it)."""
    return i % 4


async def test_eight_concurrent_duplicates_on_two_workers_run_the_handler_once(
    broker: Broker, channel: str, store: ClaimStore, db_url: str, db: asyncpg.Connection
) -> None:
    """Eight copies of one key reach two workers at once: one run, one write; every other copy
    is deferred until the outcome is there, then acknowledged as a duplicate."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    calls: list[str] = []
    app = app_for(channel, calls, delay_s=2.0, lease_s=4.0)  # outlasts the 8 publishes
    first, second = broker.transport(), broker.transport()
    async with (
        ClaimStore.open(db_url, owner="b") as other_store,
        running(app, store, first) as a,
        running(app, other_store, second) as b,
    ):
        await broker.ready(channel, first, second)
        for i in range(8):
            await broker.publish(channel, [(body(1), {}, "k1")], partition=pinned(i))

        async def settled() -> bool:
            return a.stats.duplicates + b.stats.duplicates == 7 and bool(
                a.stats.completed + b.stats.completed
            )

        await eventually(settled)
        assert a.stats.completed + b.stats.completed == 1
        assert a.stats.deferred + b.stats.deferred >= 1  # some copies ran into the live claim
    assert calls == ["k1"]
    assert await db.fetchval("SELECT count(*) FROM effects") == 1
    assert await broker.backlog(channel) == 0


async def test_a_zombie_cannot_complete_and_its_db_writes_roll_back_on_the_broker(
    broker: Broker, channel: str, store: ClaimStore, db_url: str, db: asyncpg.Connection
) -> None:
    """A run frozen past its lease (no heartbeats, as if SIGSTOPped) is taken over through a
    second copy; the zombie's completion is fenced and its ctx.db write rolled back."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL, run int)")
    started, thaw = asyncio.Event(), asyncio.Event()
    app = App("t")

    @app.handler(channel, lease_s=1.0)
    async def work(payload: Job, ctx: Context) -> None:
        await ctx.db.execute(
            "INSERT INTO effects VALUES ($1, $2, $3)", ctx.key, payload.n, ctx.attempt
        )
        if ctx.attempt == 1:  # the zombie's run: frozen until we let it go
            started.set()
            await thaw.wait()

    first, second = broker.transport(), broker.transport()
    # Neither worker heartbeats: whichever runs the first copy becomes the zombie.
    async with (
        ClaimStore.open(db_url, owner="b") as other_store,
        running(app, store, first, heartbeat_s=3600) as a,
        running(app, other_store, second, heartbeat_s=3600) as b,
    ):
        await broker.ready(channel, first, second)
        await broker.publish(channel, [(body(1), {}, "k")], partition=0)
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.sleep(1.2)  # the lease lapses
        await broker.publish(channel, [(body(1), {}, "k")], partition=1)

        async def taken_over() -> bool:
            return a.stats.completed + b.stats.completed == 1

        await eventually(taken_over)
        assert a.stats.taken_over + b.stats.taken_over == 1
        thaw.set()

        async def zombie_settled() -> bool:
            return a.stats.duplicates + b.stats.duplicates == 1

        await eventually(zombie_settled)  # its copy came back and found the outcome
        assert (a.stats.fenced + b.stats.fenced, a.stats.lease_lost + b.stats.lease_lost) == (
            1,
            1,
        )
    rows = await db.fetch("SELECT key, run FROM effects")
    assert [tuple(r) for r in rows] == [("k", 2)]  # only the take-over's write survived
    assert (
        await db.fetchval("SELECT count(*) FROM dedupe_claim_events WHERE event = 'taken_over'")
        == 1
    )
    assert await broker.backlog(channel) == 0


async def test_a_poison_message_is_dead_lettered_once_its_starts_reach_max_attempts(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Attempts are counted in the claim, across worker restarts: a key whose runs already
    killed max_attempts workers goes to <channel>.dlq without running again."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    calls: list[str] = []
    app = app_for(channel, calls, max_attempts=3, lease_s=0.2)
    request = ClaimRequest("t.work", "k", hashlib.sha256(body(1)).digest())
    for n in range(3):  # three workers claimed it, started it and died
        [claim] = await store.claim_batch([request], lease_s=0.2, retention_s=3600)
        assert claim.owned and claim.taken_over == (n > 0)
        if claim.taken_over:
            fence = Fence(claim.scope, claim.key, claim.token or 0)
            assert (
                await store.record_attempt(fence, attempt=n + 1, error=None, lease_s=0.2) == n + 1
            )
        await asyncio.sleep(0.25)
    await broker.publish(channel, [(body(1), {}, "k"), (body(2), {}, "bystander")])
    async with running(app, store, broker.transport()) as worker:

        async def settled() -> bool:
            return worker.stats.completed == 1 and await _dead_lettered(worker)

        await eventually(settled)
    [letter] = await broker.dead_letters(channel)
    assert (letter["message_id"], letter["reason"]) == ("k", "max_attempts_exceeded")
    assert "started 3 times without finishing" in letter["detail"]
    assert calls == ["bystander"]
    status = "SELECT status, dead_lettered_at IS NOT NULL FROM dedupe_claims WHERE key = 'k'"
    assert tuple(await db.fetchrow(status)) == ("failed", True)
    assert await broker.backlog(channel) == 0
