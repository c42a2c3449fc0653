"""Faults of the connections under a running worker: it reconnects and loses nothing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid

import aio_pika
import aiormq
import asyncpg
from pydantic import BaseModel

import dedupe_rabbitmq as rabbitmq
from dedupe import App, Context
from dedupe.claims.store import ClaimStore
from dedupe_rabbitmq.transport import RabbitMQTransport
from tests.conftest import eventually, running


class Job(BaseModel):
    n: int


def effect_app(channel: str) -> App:
    app = App("t")

    @app.handler(channel, lease_s=2.0, backoff_s=0.05, max_backoff_s=0.2)
    async def work(payload: Job, ctx: Context) -> None:
        await asyncio.sleep(0.005)
        await ctx.db.execute("INSERT INTO effects VALUES ($1)", ctx.key)

    return app


async def publish_stream(amqp_url: str, channel: str, count: int) -> None:
    await rabbitmq.publish(
        amqp_url, channel, [(json.dumps({"n": i}).encode(), {}, f"k{i}") for i in range(count)]
    )


async def queue_state(amqp_url: str, name: str) -> tuple[int, int]:
    """(messages ready, consumers) of a queue; raises if it does not exist."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        amqp = await connection.channel()
        queue = await amqp.declare_queue(name, passive=True)
        result = queue.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)


async def consumers(amqp_url: str, name: str) -> int:
    """The queue's consumers; 0 while it is not declared yet (the transport takes its channel
    before it declares the queues, so a test that waits on both may look in between)."""
    try:
        return (await queue_state(amqp_url, name))[1]
    except aiormq.exceptions.ChannelNotFoundEntity:
        return 0


async def all_effects_once(db: asyncpg.Connection, count: int) -> None:
    async def done() -> bool:
        return bool(await db.fetchval("SELECT count(DISTINCT key) = $1 FROM effects", count))

    await eventually(done, timeout_s=60)
    await asyncio.sleep(0.5)
    assert await db.fetchval("SELECT count(*) FROM effects") == count


async def test_the_worker_survives_its_database_connections_being_killed(
    amqp_url: str, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    """pg_terminate_backend on every worker connection mid-stream: each key still runs once."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    await publish_stream(amqp_url, channel, 300)
    async with (
        ClaimStore.open(db_url, owner="w", max_size=10) as store,
        running(effect_app(channel), store, RabbitMQTransport(amqp_url)),
    ):

        async def some() -> bool:
            return bool(await db.fetchval("SELECT count(*) >= 50 FROM effects"))

        await eventually(some)
        killed = 0
        for _ in range(3):
            killed += await db.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'dedupe-worker'"
            )
            await asyncio.sleep(0.2)
        assert killed > 0
        await all_effects_once(db, 300)


async def test_the_worker_reconnects_after_its_broker_connection_is_closed(
    amqp_url: str, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    """The broker drops the worker's connection mid-stream: it reconnects and finishes once."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    name = f"dedupe-test-{uuid.uuid4().hex[:8]}"
    await publish_stream(amqp_url, channel, 300)
    async with (
        ClaimStore.open(db_url, owner="w", max_size=10) as store,
        running(effect_app(channel), store, RabbitMQTransport(amqp_url, connection_name=name)),
    ):

        async def some() -> bool:
            return bool(await db.fetchval("SELECT count(*) >= 50 FROM effects"))

        await eventually(some)
        listing = await asyncio.to_thread(
            subprocess.run,
            ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        ours = [line.split("\t")[0] for line in listing.stdout.splitlines() if name in line]
        assert ours, "the worker's connection is not listed"
        for connection in ours:
            await asyncio.to_thread(
                subprocess.run,
                ["rabbitmqctl", "-q", "close_connection", connection, "test: broker fault"],
                timeout=30,
                check=True,
            )
        await all_effects_once(db, 300)


async def test_dead_letters_still_go_out_when_the_copy_channel_was_lost(
    amqp_url: str, channel: str, store: ClaimStore
) -> None:
    """The channel for dead letters and delays closed for good under a running worker (as
    when aio-pika's restore fails while the broker shuts down): the next dead letter opens a
    new one, so a poison message still reaches <channel>.dlq instead of coming back forever."""
    app = App("t")

    @app.handler(channel, max_attempts=1)
    async def work(payload: Job) -> None:
        raise ValueError("poison")

    transport = RabbitMQTransport(amqp_url)
    async with running(app, store, transport):

        async def connected() -> bool:
            return transport.copies.channel is not None

        await eventually(connected)
        assert transport.copies.channel is not None
        await transport.copies.channel.close()
        await publish_stream(amqp_url, channel, 2)

        async def dead_lettered() -> bool:
            return len(await rabbitmq.peek_dead_letters(amqp_url, channel, limit=10)) == 2

        await eventually(dead_lettered, timeout_s=20)
    letters = await rabbitmq.peek_dead_letters(amqp_url, channel, limit=10)
    assert sorted(letter["key"] for letter in letters) == ["k0", "k1"]
    assert {letter["reason"] for letter in letters} == {"max_attempts_exceeded"}


async def test_consuming_resumes_when_the_consuming_channel_was_lost(
    amqp_url: str, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    """The consuming channel closed for good under a running worker (a failed restore): the
    watchdog consumes on a new channel, so the worker does not sit idle while messages wait."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    transport = RabbitMQTransport(amqp_url)
    transport.WATCH_S = 0.5
    async with (
        ClaimStore.open(db_url, owner="w", max_size=10) as store,
        running(effect_app(channel), store, transport),
    ):

        async def consuming() -> bool:
            # The broker sees the consumer: the queues are declared and consumed (closing the
            # channel earlier tests the start, test_rabbitmq_consumer.py does that).
            return transport._channel is not None and await consumers(amqp_url, channel) == 1

        await eventually(consuming)
        assert transport._channel is not None
        await transport._channel.close()
        await publish_stream(amqp_url, channel, 50)
        await all_effects_once(db, 50)
