"""The Kafka transport against the real broker: offsets, rebalances, pause/resume, retries,
dead letters and offset keys."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiokafka
import asyncpg
import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from pydantic import BaseModel

import dedupe_kafka as kafka
from dedupe import App, Context
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.transport import Action, Delivery, Settlement
from dedupe_kafka.publisher import KafkaPublisher
from dedupe_kafka.transport import KafkaTransport
from tests.conftest import eventually, running
from tests.integration.brokers import KafkaBroker


class Job(BaseModel):
    n: int
    sleep_s: float = 0.0


def body(n: int, **extra: object) -> bytes:
    return json.dumps({"n": n, **extra}).encode()


@pytest.fixture
async def effects(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL, at float8)")
    return db


def recording_app(channel: str, calls: list[str], **options: Any) -> App:
    app = App("t")

    @app.handler(channel, **options)
    async def work(payload: Job, ctx: Context) -> int:
        calls.append(ctx.key)
        await asyncio.sleep(payload.sleep_s)
        await ctx.db.execute(
            "INSERT INTO effects VALUES ($1, $2, $3)", ctx.key, payload.n, time.monotonic()
        )
        return payload.n

    return app


async def test_the_committed_offset_stops_at_the_first_message_without_an_outcome(
    kafka_url: str, channel: str, store: ClaimStore, db_url: str, effects: asyncpg.Connection
) -> None:
    """A message deferred (its key runs elsewhere) holds the offset back while later ones
    complete; once it settles as a duplicate, the group commits to the end."""
    broker = KafkaBroker(kafka_url, partitions=1)
    calls: list[str] = []
    app = recording_app(channel, calls, lease_s=1.5)
    async with ClaimStore.open(db_url, owner="elsewhere") as other:
        [held] = await other.claim_batch(
            [ClaimRequest("t.work", "k2", hashlib.sha256(body(2)).digest())],
            lease_s=60,
            retention_s=86_400 * 7,
        )
        assert held.token is not None
        await broker.publish(channel, [(body(i), {}, f"k{i}") for i in range(6)])
        async with running(app, store, broker.transport()) as worker:

            async def others_done() -> bool:
                return worker.stats.completed == 5 and await broker.backlog(channel) == 4

            await eventually(others_done)
            assert worker.stats.deferred >= 1
            # The other worker finishes k2: our held copy now finds a duplicate.
            await other.complete([(Fence("t.work", "k2", held.token), "2", 86_400 * 7)])

            async def all_committed() -> bool:
                return await broker.backlog(channel) == 0

            await eventually(all_committed)
            assert worker.stats.duplicates == 1
    assert sorted(calls) == ["k0", "k1", "k3", "k4", "k5"]


async def test_offsets_are_committed_in_batches_not_per_message(
    kafka_url: str,
    channel: str,
    store: ClaimStore,
    effects: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three hundred messages, a handful of commit requests, each covering many messages."""
    commits: list[dict[Any, int]] = []
    original = aiokafka.AIOKafkaConsumer.commit

    async def spy(self: aiokafka.AIOKafkaConsumer, offsets: Any = None) -> None:
        commits.append(dict(offsets))
        await original(self, offsets)

    monkeypatch.setattr(aiokafka.AIOKafkaConsumer, "commit", spy)
    broker = KafkaBroker(kafka_url)
    calls: list[str] = []
    await broker.publish(channel, [(body(i), {}, f"k{i}") for i in range(300)])
    async with running(recording_app(channel, calls), store, broker.transport()) as worker:

        async def done() -> bool:
            return worker.stats.completed == 300

        await eventually(done)
    assert await broker.backlog(channel) == 0
    assert len(calls) == 300
    assert 1 <= len(commits) <= 30
    assert sum(len(c) for c in commits) < 300 / 4


async def test_a_handler_longer_than_max_poll_interval_keeps_its_partitions(
    kafka_url: str, channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """The busy partition is paused, not starved of polls: no eviction, no rebalance, and the
    other partitions keep flowing meanwhile."""
    broker = KafkaBroker(kafka_url, max_poll_interval_ms=1500, session_timeout_ms=6000)
    calls: list[str] = []
    transport = broker.transport()
    async with running(recording_app(channel, calls), store, transport) as worker:
        await broker.ready(channel, transport)
        await broker.publish(channel, [(body(0, sleep_s=8.0), {}, "slow")], partition=0)
        await broker.publish(channel, [(body(i), {}, f"k{i}") for i in range(40)], partition=1)

        async def fast_done() -> bool:
            return worker.stats.completed == 40

        await eventually(fast_done, timeout_s=6)  # while "slow" still runs

        async def slow_done() -> bool:
            return worker.stats.completed == 41

        await eventually(slow_done)
        assert isinstance(transport, KafkaTransport)
        assert transport.rebalances == 1  # the first assignment only
    assert calls.count("slow") == 1
    assert await broker.backlog(channel) == 0


async def test_retries_with_backoff_do_not_stall_other_partitions(
    kafka_url: str, channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A message failing transiently waits out its backoff in its own partition only."""
    broker = KafkaBroker(kafka_url)
    app = App("t")
    attempts: list[float] = []
    done_at: dict[str, float] = {}

    # Backoffs long enough that the other partitions' three publishes (a producer each) finish
    # well inside them on a loaded machine.
    @app.handler(channel, backoff_s=2.0, max_backoff_s=3.0)
    async def work(payload: Job, ctx: Context) -> None:
        if ctx.key == "flaky" and len(attempts) < 2:
            attempts.append(time.monotonic())
            raise ConnectionError("downstream hiccup")
        done_at[ctx.key] = time.monotonic()

    transport = broker.transport()
    async with running(app, store, transport) as worker:
        await broker.ready(channel, transport)
        await broker.publish(channel, [(body(0), {}, "flaky")], partition=0)
        await asyncio.sleep(0.2)
        for partition in (1, 2, 3):
            await broker.publish(
                channel,
                [(body(i), {}, f"p{partition}-{i}") for i in range(10)],
                partition=partition,
            )

        async def done() -> bool:
            return worker.stats.completed == 31

        await eventually(done)
    others = [at for key, at in done_at.items() if key != "flaky"]
    assert worker.stats.retried == 2
    assert max(others) < done_at["flaky"]  # the others did not wait for flaky's backoff


async def test_dead_letters_keep_the_record_key_and_headers_and_say_where_they_came_from(
    kafka_url: str, channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    broker = KafkaBroker(kafka_url)
    calls: list[str] = []
    await broker.publish(channel, [(b"{oops", {"x-trace": "t-1"}, "m1")], partition=2)
    async with running(recording_app(channel, calls), store, broker.transport()) as worker:

        async def dead() -> bool:
            return sum(worker.stats.dead_lettered.values()) == 1

        await eventually(dead)
    [letter] = await broker.dead_letters(channel)
    assert letter["reason"] == "invalid_payload"
    assert (letter["scope"], letter["key"]) == ("t.work", "m1")
    assert letter["record_key"] == b"m1"
    assert letter["origin"] == f"{channel}/2/0"
    assert letter["headers"]["x-trace"] == "t-1"
    assert letter["headers"]["message-id"] == "m1"
    assert await broker.backlog(channel) == 0
    assert calls == []


async def test_the_publisher_sets_the_id_that_the_default_key_reads(
    kafka_url: str, channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """KafkaPublisher (the receiver's Publisher) writes `message-id`; copies dedupe on it."""
    broker = KafkaBroker(kafka_url)
    calls: list[str] = []
    async with KafkaPublisher(broker.url) as publisher:
        for _ in range(3):
            await publisher.publish(
                channel, body(1), message_id="gh/123", headers={"X-GitHub-Event": "push"}
            )
    async with running(recording_app(channel, calls), store, broker.transport()) as worker:

        async def done() -> bool:
            return worker.stats.completed + worker.stats.duplicates == 3

        await eventually(done)
    assert calls == ["gh/123"]


async def rewind(url: str, group_id: str, topic: str) -> None:
    """Move the group back to the start of the topic (a redelivery of everything)."""
    options = kafka.KafkaOptions.from_url(url)
    consumer = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=options.bootstrap_servers, group_id=group_id, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [aiokafka.TopicPartition(topic, p) for p in range(options.partitions)]
        consumer.assign(tps)
        await consumer.commit(dict.fromkeys(tps, 0))
    finally:
        await consumer.stop()


async def test_kafka_offset_keys_turn_a_redelivery_of_id_less_messages_into_duplicates(
    kafka_url: str, channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Producers that set no id: key="kafka:offset" recognises the same record read again."""
    broker = KafkaBroker(kafka_url)
    calls: list[str] = []
    app = recording_app(channel, calls, key="kafka:offset")
    await broker.publish(channel, [(body(i), {}, None) for i in range(20)])
    async with running(app, store, broker.transport()) as worker:

        async def first() -> bool:
            return worker.stats.completed == 20

        await eventually(first)
    await rewind(broker.url, broker.group_id, channel)
    assert await broker.backlog(channel) == 20
    async with running(app, store, broker.transport()) as again:

        async def second() -> bool:
            return again.stats.duplicates == 20

        await eventually(second)
    assert len(calls) == 20
    assert all(key.startswith(f"{channel}/") for key in calls)
    assert await broker.backlog(channel) == 0


@contextlib.asynccontextmanager
async def worker_in(
    app: App, store: ClaimStore, transport: KafkaTransport
) -> AsyncIterator[tuple[Processor, asyncio.Event]]:
    """A worker that a test can stop on its own (graceful: it leaves the group)."""
    stop = asyncio.Event()
    async with Processor(app, store) as processor:
        serving = asyncio.create_task(transport.serve(list(app.channels), processor.process, stop))
        try:
            yield processor, stop
        finally:
            stop.set()
            await processor.drain(timeout_s=10)
            await serving
            await transport.close()


async def test_a_consumer_joining_and_one_leaving_mid_stream_run_every_key_once(
    kafka_url: str, channel: str, db_url: str, effects: asyncpg.Connection
) -> None:
    """Rebalances while messages flow: in-flight work finishes before offsets move, so no
    handler runs twice and nothing is lost; revocation commits what was done, so the new owners
    read nothing again (the only duplicates are the copies published). (A revoke gives back
    the claims whose handlers have not started, and a record done after one of those is read
    again as a duplicate: this stream is light enough that no claim waits for a runner.)"""
    # Periodic commits rarely, so that what was done since the last one is read again unless
    # the revocation commits it.
    broker = KafkaBroker(kafka_url, commit_interval_s=2.0)
    calls: list[str] = []
    app = recording_app(channel, calls)
    unique = 600
    stream = [(body(i, sleep_s=0.02), {}, f"k{i}") for i in range(unique)]
    stream += stream[::5]  # a fifth published twice

    async def produce() -> None:
        for start in range(0, len(stream), 40):
            await broker.publish(channel, stream[start : start + 40])
            await asyncio.sleep(0.1)

    async with contextlib.AsyncExitStack() as stack:
        stores = [
            await stack.enter_async_context(ClaimStore.open(db_url, owner=f"w{i}"))
            for i in range(3)
        ]
        a, b, c = (broker.transport() for _ in range(3))
        (worker_a, stop_a) = await stack.enter_async_context(worker_in(app, stores[0], a))
        (worker_b, _) = await stack.enter_async_context(worker_in(app, stores[1], b))
        await broker.ready(channel, a, b)
        producer = asyncio.create_task(produce())

        async def progressed(n: int) -> bool:
            return bool(await effects.fetchval("SELECT count(*) >= $1 FROM effects", n))

        await eventually(lambda: progressed(100))
        (worker_c, _) = await stack.enter_async_context(worker_in(app, stores[2], c))  # joins
        await eventually(lambda: progressed(300))
        stop_a.set()  # one leaves (gracefully: finishes, commits, leaves the group)
        await producer

        async def all_done() -> bool:
            return await effects.fetchval("SELECT count(DISTINCT key) FROM effects") == unique

        await eventually(all_done, timeout_s=60)

        # The rebalance after a left may land after the stream is done: wait for b and c to
        # share every partition rather than race it. (Counting rebalances does not work: the
        # group may fold c's join and a's leave into one round.)
        await broker.ready(channel, b, c, timeout_s=60)

        async def drained() -> bool:
            return await broker.backlog(channel) == 0

        await eventually(drained)
    assert await effects.fetchval("SELECT count(*) FROM effects") == unique
    assert len(calls) == unique  # not even a handler ran twice
    workers = (worker_a, worker_b, worker_c)
    assert sum(w.stats.completed for w in workers) == unique
    assert sum(w.stats.duplicates for w in workers) == len(stream) - unique


async def test_a_revoke_gives_back_the_claims_no_handler_runs_yet_and_waits_only_for_the_runs(
    kafka_url: str, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    """A rebalance takes a partition whose fetched batch is claimed but mostly queued behind
    slow handlers: the revoke waits for the runs under way only (not the queue's handler
    time), starts none, and gives the queued claims back (free at once, no attempt charged);
    the next owner runs them, and no key's handler runs twice."""
    broker = KafkaBroker(kafka_url, partitions=1)
    calls: list[int] = []
    app = App("t")

    @app.handler(channel, lease_s=30)
    async def work(payload: Job) -> int:
        calls.append(payload.n)
        await asyncio.sleep(0.5)
        return payload.n

    count, concurrency = 48, 4  # the queue alone: (48 - 4) / 4 x 0.5 s = 5.5 s of handlers
    await broker.publish(channel, [(body(i), {}, f"k{i}") for i in range(count)])
    revokes: list[dict[str, Any]] = []
    a = broker.transport()
    revoke = a.revoke

    async def timed_revoke(revoked: set[aiokafka.TopicPartition]) -> None:
        if revokes or not any(tp.topic == channel for tp in a.assignment & revoked):
            await revoke(revoked)  # (the first revoke of the channel's partition is the test's)
            return
        before, began = set(calls), time.monotonic()
        await revoke(revoked)
        held = await db.fetchval(
            "SELECT count(*) FROM dedupe_claims"
            " WHERE status = 'in_progress' AND lease_until > now()"
        )
        handed_back = await db.fetch(
            "SELECT key, attempts FROM dedupe_claims WHERE status = 'in_progress'"
            " AND error = 'handed back' AND lease_until <= now()"
        )
        revokes.append(
            {
                "s": time.monotonic() - began,
                "before": before,
                "after": set(calls),
                "held": held,
                "handed_back": {r["key"]: r["attempts"] for r in handed_back},
            }
        )

    a.revoke = timed_revoke  # type: ignore[method-assign]
    async with contextlib.AsyncExitStack() as stack:
        stores = [
            await stack.enter_async_context(ClaimStore.open(db_url, owner=f"w{i}"))
            for i in range(2)
        ]
        await stack.enter_async_context(running(app, stores[0], a, concurrency=concurrency))

        async def claimed_and_running() -> bool:
            rows = await db.fetchval("SELECT count(*) FROM dedupe_claims")
            return rows == count and len(calls) >= concurrency

        await eventually(claimed_and_running)
        b = broker.transport()
        await stack.enter_async_context(running(app, stores[1], b, concurrency=concurrency))

        async def revoked() -> bool:
            return bool(revokes)

        await eventually(revoked)
        [first] = revokes[:1]
        # Only the runs under way when the revoke began ran on: nothing started since.
        assert first["after"] == first["before"]
        assert len(first["before"]) < count // 2
        assert first["s"] < 2.5  # about one handler run (0.5 s), not the queue's 5.5 s
        assert first["held"] == 0  # nothing left under a live lease for the next owner
        unstarted = {f"k{i}" for i in range(count)} - {f"k{n}" for n in first["before"]}
        assert first["handed_back"] == dict.fromkeys(unstarted, 0)  # no attempt charged

        async def all_done() -> bool:
            done = await db.fetchval(
                "SELECT count(*) FROM dedupe_claims WHERE status = 'completed'"
            )
            return done == count and await broker.backlog(channel) == 0

        await eventually(all_done, timeout_s=60)
    assert sorted(calls) == list(range(count))  # each key's handler ran once, none twice
    assert await db.fetchval("SELECT max(attempts) FROM dedupe_claims") == 1


class HeldRun:
    """One record's batch held mid-run until `release` is set (then acknowledged); `running`
    is set once it runs."""

    def __init__(self) -> None:
        self.release, self.running = asyncio.Event(), asyncio.Event()

    async def process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        self.running.set()
        await self.release.wait()
        for delivery in deliveries:
            await delivery.settle(Settlement(Action.ACK))


async def test_a_stop_during_a_revoke_waits_for_the_revokes_commit(
    kafka_url: str, channel: str
) -> None:
    """The group rebalances as the worker stops (another member left): the revoke under way
    commits what its partitions finished before the consumer stops (the offsets of a clean
    stop are not left to be read again)."""
    broker = KafkaBroker(kafka_url, partitions=1)
    await broker.publish(channel, [(body(1), {}, "k1")])
    run = HeldRun()
    transport, stop = broker.transport(), asyncio.Event()
    serving = asyncio.create_task(transport.serve([channel], run.process, stop))
    try:
        await asyncio.wait_for(run.running.wait(), 30)
        # What the group's revoke callback does: it waits for the run under way, then commits.
        revoke = asyncio.create_task(transport.revoke(set(transport.assignment)))
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.sleep(0.5)  # the stop gets as far as it can while the run goes on
        run.release.set()
        await asyncio.wait_for(asyncio.gather(revoke, serving), 30)
    finally:
        run.release.set()
        stop.set()
        await asyncio.gather(serving, return_exceptions=True)
        await transport.close()
    assert await broker.backlog(channel) == 0


async def test_a_revoke_during_a_stop_waits_no_longer_than_its_own_bound(
    kafka_url: str, channel: str
) -> None:
    """The worker stops first and waits for its run; a rebalance then revokes the partition:
    the revoke waits for that run no longer than revoke_timeout_s, not for the whole stop."""
    broker = KafkaBroker(kafka_url, partitions=1)
    await broker.publish(channel, [(body(1), {}, "k1")])
    run = HeldRun()
    transport, stop = broker.transport(revoke_timeout_s=0.5), asyncio.Event()
    serving = asyncio.create_task(transport.serve([channel], run.process, stop))
    try:
        await asyncio.wait_for(run.running.wait(), 30)
        stop.set()
        await asyncio.sleep(0.3)  # the stop waits for the run under way
        began = time.monotonic()
        await asyncio.wait_for(transport.revoke(set(transport.assignment)), 10)
        assert time.monotonic() - began < 2.0  # its own bound (0.5 s), not the stop's wait
        run.release.set()
        await asyncio.wait_for(serving, 30)
    finally:
        run.release.set()
        stop.set()
        await asyncio.gather(serving, return_exceptions=True)
        await transport.close()


async def test_a_dead_letter_too_large_for_the_broker_goes_out_without_its_body(
    kafka_url: str, channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A record just under the size limit is fine, its copy plus the reason headers is not:
    the dead letter goes out without the body, says why, and the offset moves past it."""
    broker = KafkaBroker(kafka_url)
    calls: list[str] = []
    limit = 1_048_576  # the producer's max_request_size (the broker's limit is a bit higher)
    headers = [("message-id", b"big")]
    overhead = DefaultRecordBatchBuilder.estimate_size_in_bytes(b"big", b"", headers)
    value = b"x" * (limit - overhead - 8)  # not JSON: dead-lettered as invalid_payload
    assert DefaultRecordBatchBuilder.estimate_size_in_bytes(b"big", value, headers) <= limit
    await broker.publish(channel, [(value, {}, "big"), (body(1), {}, "after")], partition=0)
    async with running(recording_app(channel, calls), store, broker.transport()) as worker:

        async def settled() -> bool:
            return worker.stats.completed == 1 and await broker.backlog(channel) == 0

        await eventually(settled)
    [letter] = await broker.dead_letters(channel)
    assert (letter["message_id"], letter["reason"], letter["bytes"]) == (
        "big",
        "invalid_payload",
        0,
    )
    assert (letter["scope"], letter["key"], letter["origin"]) == ("t.work", "big", f"{channel}/0/0")
    assert letter["body_dropped"].startswith(f"{len(value)} bytes: ")
    assert "MessageSizeTooLargeError" in letter["body_dropped"]
    assert await effects.fetchval(
        "SELECT dead_lettered_at IS NOT NULL FROM dedupe_claims WHERE key = 'big'"
    )
    assert calls == ["after"]
    # Replaying it cannot run it again: it is skipped, its claim left alone.
    released: list[tuple[str, str]] = []

    async def release(scope: str, key: str) -> None:
        released.append((scope, key))

    assert await broker.replay(channel, release) == []
    assert released == []


async def test_a_fetch_hands_over_at_most_batch_max_records(
    kafka_url: str,
    channel: str,
    store: ClaimStore,
    effects: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fetched batch and a claim batch are the same thing: getmany asks for batch_max."""
    fetched: list[int] = []
    original = aiokafka.AIOKafkaConsumer.getmany

    async def spy(self: aiokafka.AIOKafkaConsumer, *tps: Any, **options: Any) -> Any:
        batches = await original(self, *tps, **options)
        fetched.append(sum(len(records) for records in batches.values()))
        return batches

    monkeypatch.setattr(aiokafka.AIOKafkaConsumer, "getmany", spy)
    broker = KafkaBroker(kafka_url, batch_max=7)
    calls: list[str] = []
    await broker.publish(channel, [(body(i), {}, f"k{i}") for i in range(100)], partition=0)
    async with running(recording_app(channel, calls), store, broker.transport()) as worker:

        async def done() -> bool:
            return worker.stats.completed == 100

        await eventually(done)
    assert max(fetched) == 7
    assert len(calls) == 100
