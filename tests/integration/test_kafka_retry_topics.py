"""Kafka retry topics against the real broker: a deferral of 5 s or more waits in
`<channel>.retry.<bucket>`, not in memory, so its partition commits past it; a copy in a retry
topic runs as a message of its channel, and not before it is due.

Topic names are written out here (not taken from dedupe_kafka.retries) so that these tests
describe the broker's view on their own."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

import aiokafka
import asyncpg

import dedupe_kafka as kafka
from dedupe import App, Context, Message, Retry
from dedupe.claims.records import ClaimRequest
from dedupe.claims.store import ClaimStore
from dedupe_kafka.publisher import admin_client
from tests.conftest import eventually, running
from tests.integration.brokers import KafkaBroker


def body(n: int) -> bytes:
    return json.dumps({"n": n}).encode()


async def end_offset(url: str, topic: str) -> int:
    """Records written to the topic so far (all partitions); 0 if it does not exist."""
    options = kafka.KafkaOptions.from_url(url)
    async with admin_client(options) as admin:
        tps = await kafka.partitions_of(admin, topic)
    if not tps:
        return 0
    consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=options.bootstrap_servers)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    return sum(ends.values())


async def write_copy(broker: KafkaBroker, topic: str, channel: str, due: float) -> None:
    """A copy of message m1 (deferred once, from offset 41 of the channel) in a retry topic,
    due at `due` (epoch seconds), as a worker writes it."""
    producer = await kafka.idempotent_producer(kafka.KafkaOptions.from_url(broker.url))
    try:
        await producer.send_and_wait(
            topic,
            value=body(1),
            key=b"m1",
            headers=[
                ("message-id", b"m1"),
                ("x-dedupe-deferrals", b"1"),
                ("x-dedupe-due-at", str(int(due * 1000)).encode()),
                ("x-dedupe-origin", f"{channel}/0/41".encode()),
            ],
            partition=0,
        )
    finally:
        await producer.stop()


def attempts_app(channel: str, runs: list[tuple[str, int, str, float]], **options: Any) -> App:
    """Records (key, the message's attempt, its channel, when) of each run."""
    app = App("t")

    @app.handler(channel, **options)
    async def work(message: Message, ctx: Context) -> None:
        runs.append((ctx.key, message.attempt, message.channel, time.time()))

    return app


async def test_a_deferral_waits_in_a_retry_topic_while_its_partition_commits_past_it(
    kafka_url: str, channel: str, store: ClaimStore, db_url: str, db: asyncpg.Connection
) -> None:
    """A record whose key another worker holds is deferred 6 s (lease_s / 3): it goes to
    `<channel>.retry.30s`, the later record of its partition completes and the group commits
    past both while the copy waits; the copy then runs once, as attempt 2 of its channel."""
    broker = KafkaBroker(kafka_url, partitions=1)
    runs: list[tuple[str, int, str, float]] = []
    app = attempts_app(channel, runs, lease_s=18.0)
    async with ClaimStore.open(db_url, owner="elsewhere") as other:
        # Another worker holds "slow" for 2 s and dies: the copy takes the key over.
        [held] = await other.claim_batch(
            [ClaimRequest("t.work", "slow", hashlib.sha256(body(1)).digest())],
            lease_s=2,
            retention_s=86_400,
        )
        assert held.token is not None
    await broker.publish(channel, [(body(1), {}, "slow"), (body(2), {}, "later")], partition=0)
    began = time.time()
    transport = broker.transport()
    async with running(app, store, transport) as worker:

        async def committed_past_both() -> bool:
            return await kafka.backlog(broker.url, channel, broker.group_id) == 0

        # Well before the 6 s deferral ends (held in memory, the partition stayed at 0).
        await eventually(committed_past_both, timeout_s=5)
        assert [key for key, *_ in runs] == ["later"]
        assert worker.stats.deferred == 1
        assert await end_offset(broker.url, f"{channel}.retry.30s") == 1

        async def retried() -> bool:
            return len(runs) == 2

        await eventually(retried, timeout_s=15)
        key, attempt, on, at = runs[1]
        assert (key, attempt, on) == ("slow", 2, channel)
        assert at >= began + 6.0

        async def retry_committed() -> bool:
            return await broker.backlog(channel) == 0  # the channel and its retry topics

        await eventually(retry_committed, timeout_s=5)
        assert worker.stats.completed == 2
    assert await db.fetchval("SELECT status FROM dedupe_claims WHERE key = 'slow'") == "completed"
    for bucket in ("5s", "2m", "10m", "1h"):
        assert await end_offset(broker.url, f"{channel}.retry.{bucket}") == 0


async def test_a_copy_in_a_retry_topic_does_not_run_before_it_is_due(
    kafka_url: str, channel: str, store: ClaimStore
) -> None:
    """A copy due in 3 s, fetched at once, runs after 3 s as attempt 2 of its channel, and its
    offset is committed only then."""
    broker = KafkaBroker(kafka_url, partitions=1)
    retry_topic = f"{channel}.retry.5s"
    runs: list[tuple[str, int, str, float]] = []
    transport = broker.transport()
    async with running(attempts_app(channel, runs), store, transport) as worker:
        await broker.ready(channel, transport)
        due = time.time() + 3.0
        await write_copy(broker, retry_topic, channel, due)
        await asyncio.sleep(1.5)
        assert runs == []
        # Not committed past while it waits.
        assert await kafka.backlog(broker.url, retry_topic, broker.group_id) == 1

        async def ran() -> bool:
            lag = await kafka.backlog(broker.url, retry_topic, broker.group_id)
            return worker.stats.completed == 1 and lag == 0

        await eventually(ran, timeout_s=10)
    [(key, attempt, on, at)] = runs
    assert (key, attempt, on) == ("m1", 2, channel)
    assert at >= due


async def test_a_copy_due_after_its_buckets_bound_is_carried_on_until_it_is_due(
    kafka_url: str, channel: str, store: ClaimStore
) -> None:
    """A copy in `.retry.5s` due in 12 s (as a deferral longer than the last bucket waits an
    hour at a time): at its bucket's bound it is copied on to `.retry.30s` with its headers,
    not run, and it runs once, as attempt 2, when it is due."""
    broker = KafkaBroker(kafka_url, partitions=1)
    runs: list[tuple[str, int, str, float]] = []
    transport = broker.transport()
    async with running(attempts_app(channel, runs), store, transport) as worker:
        await broker.ready(channel, transport)
        due = time.time() + 12.0
        await write_copy(broker, f"{channel}.retry.5s", channel, due)

        async def carried() -> bool:
            return await end_offset(broker.url, f"{channel}.retry.30s") == 1

        await eventually(carried, timeout_s=10)
        assert runs == []

        async def ran() -> bool:
            return worker.stats.completed == 1

        await eventually(ran, timeout_s=20)
    [(key, attempt, on, at)] = runs
    assert (key, attempt, on) == ("m1", 2, channel)
    assert at >= due


async def test_a_handler_retrying_after_6s_goes_through_the_retry_topic(
    kafka_url: str, channel: str, store: ClaimStore
) -> None:
    """Retry(delay_s=6) once: the record waits in `<channel>.retry.30s`, the later record of
    its partition is committed meanwhile, and it runs again once, as attempt 2."""
    broker = KafkaBroker(kafka_url, partitions=1)
    runs: list[tuple[str, int, str, float]] = []
    retried: list[bool] = []
    app = App("t")

    @app.handler(channel)
    async def work(message: Message, ctx: Context) -> None:
        runs.append((ctx.key, message.attempt, message.channel, time.time()))
        if ctx.key == "slow" and not retried:
            retried.append(True)
            raise Retry(delay_s=6)

    await broker.publish(channel, [(body(1), {}, "slow"), (body(2), {}, "later")], partition=0)
    began = time.time()
    async with running(app, store, broker.transport()):

        async def committed_past_both() -> bool:
            return await kafka.backlog(broker.url, channel, broker.group_id) == 0

        await eventually(committed_past_both, timeout_s=5)
        assert sorted(key for key, *_ in runs) == ["later", "slow"]
        assert await end_offset(broker.url, f"{channel}.retry.30s") == 1

        async def retried() -> bool:
            return len(runs) == 3

        await eventually(retried, timeout_s=15)
    assert runs[2][:3] == ("slow", 2, channel)
    assert runs[2][3] >= began + 6.0


async def test_a_copy_that_fails_for_good_is_dead_lettered_to_its_channel(
    kafka_url: str, channel: str, store: ClaimStore
) -> None:
    """Its dead letter goes to `<channel>.dlq`, says the original record is its origin and
    carries none of the retry headers (a replay must not read it as deferred)."""
    broker = KafkaBroker(kafka_url, partitions=1)
    app = App("t")

    @app.handler(channel)
    async def work(payload: dict[str, int], ctx: Context) -> None: ...

    transport = broker.transport()
    async with running(app, store, transport) as worker:
        await broker.ready(channel, transport)
        producer = await kafka.idempotent_producer(kafka.KafkaOptions.from_url(broker.url))
        try:
            await producer.send_and_wait(
                f"{channel}.retry.30s",
                value=b"{oops",
                key=b"m1",
                headers=[
                    ("message-id", b"m1"),
                    ("x-dedupe-deferrals", b"2"),
                    ("x-dedupe-due-at", str(int(time.time() * 1000)).encode()),
                    ("x-dedupe-origin", f"{channel}/0/7".encode()),
                ],
            )
        finally:
            await producer.stop()

        async def dead() -> bool:
            return sum(worker.stats.dead_lettered.values()) == 1 and not await broker.backlog(
                channel
            )

        await eventually(dead, timeout_s=10)
    [letter] = await broker.dead_letters(channel)
    assert (letter["reason"], letter["key"], letter["origin"]) == (
        "invalid_payload",
        "m1",
        f"{channel}/0/7",
    )
    assert not {"x-dedupe-deferrals", "x-dedupe-due-at"} & set(letter["headers"])
    assert await end_offset(broker.url, f"{channel}.retry.30s.dlq") == 0
