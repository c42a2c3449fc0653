"""Copies RabbitMQ cannot route: a dead letter or deferral whose queue an operator deleted (or a
policy expired) is never acked into nothing. The transport declares the channel's queues again
and sends the copy once more; if that fails too, the original goes back to its queue."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import aiormq
import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context, Reject
from dedupe.claims.records import ClaimRequest, Reason
from dedupe.claims.store import ClaimStore
from dedupe.transport import Action, Settlement, dlq_name
from dedupe_rabbitmq.topology import declare_channel, declare_queues, delay_name
from dedupe_rabbitmq.transport import RabbitDelivery, RabbitMQTransport
from tests.conftest import eventually, running


class Job(BaseModel):
    n: int


def body(n: int) -> bytes:
    return json.dumps({"n": n}).encode()


async def consuming(amqp_url: str, channel: str) -> None:
    """Wait until a worker consumes the channel (so it has declared its queues)."""

    async def attached() -> bool:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            amqp = await connection.channel()
            try:
                queue = await amqp.declare_queue(channel, passive=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                return False  # not declared yet
            return bool(queue.declaration_result.consumer_count)

    await eventually(attached, timeout_s=10)


async def delete_queues(amqp_url: str, *names: str) -> None:
    """What an operator (or an expiry policy) does under a running worker."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        for name in names:
            await amqp.queue_delete(name)


async def send(amqp_url: str, channel: str, *messages: tuple[bytes, str, dict[str, Any]]) -> None:
    """Publish (body, message id, headers) straight to the work queue, declaring nothing."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel(publisher_confirms=True)
        for payload, message_id, headers in messages:
            await amqp.default_exchange.publish(
                aio_pika.Message(payload, message_id=message_id, headers=headers),
                routing_key=channel,
            )


@contextlib.asynccontextmanager
async def fetched(
    amqp_url: str, channel: str, *messages: tuple[bytes, str, dict[str, Any]]
) -> AsyncIterator[tuple[aiormq.abc.AbstractChannel, list[RabbitDelivery]]]:
    """The channel's queues declared, `messages` sent and fetched (unacked) as deliveries of a
    connected transport, to be settled by the test; an AMQP channel of the test's own."""
    transport = RabbitMQTransport(amqp_url)
    connection = await aiormq.connect(amqp_url)
    try:
        await transport.connect()
        amqp = await connection.channel()
        await declare_queues(amqp, channel)
        await send(amqp_url, channel, *messages)
        deliveries = []
        for _ in messages:
            frame = await amqp.basic_get(channel, no_ack=False, timeout=5)
            deliveries.append(RabbitDelivery(transport, channel, frame))
        yield amqp, deliveries
    finally:
        await transport.close()
        await connection.close()


async def queued(amqp_url: str, name: str) -> int:
    """How many messages a queue holds; 0 when it does not exist."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        try:
            queue = await amqp.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return 0
        return int(queue.declaration_result.message_count or 0)


def rejecting_app(channel: str, **options: object) -> App:
    app = App("t")

    @app.handler(channel, **options)  # type: ignore[arg-type]
    async def work(payload: Job) -> None:
        raise Reject("not wanted")

    return app


async def test_a_dead_letter_whose_dlq_was_deleted_lands_in_the_dlq_declared_again(
    amqp_url: str, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The worker re-declares <channel>.dlq for the returned dead letter and records it as sent."""
    async with running(rejecting_app(channel), store, RabbitMQTransport(amqp_url)):
        await consuming(amqp_url, channel)
        await delete_queues(amqp_url, dlq_name(channel))
        await send(amqp_url, channel, (body(1), "k", {}))

        async def dead_lettered() -> int:
            return await queued(amqp_url, dlq_name(channel))

        await eventually(dead_lettered, timeout_s=10)
    assert await queued(amqp_url, dlq_name(channel)) == 1
    assert await queued(amqp_url, channel) == 0
    assert await db.fetchval("SELECT dead_lettered_at IS NOT NULL FROM dedupe_claims")


async def test_a_deferral_whose_delay_queue_was_deleted_still_comes_back_and_runs(
    amqp_url: str, channel: str, store: ClaimStore, db_url: str
) -> None:
    """A key in progress elsewhere is deferred into a re-declared <channel>.delay and runs once
    the other worker's lease lapses."""
    calls: list[str] = []
    app = App("t")

    @app.handler(channel, lease_s=1.5)
    async def work(payload: Job, ctx: Context) -> None:
        calls.append(ctx.key)

    async with ClaimStore.open(db_url, owner="elsewhere") as other:
        [claim] = await other.claim_batch(
            [ClaimRequest("t.work", "k", hashlib.sha256(body(1)).digest())],
            lease_s=2.0,
            retention_s=3600,
        )
        assert claim.owned
        async with running(app, store, RabbitMQTransport(amqp_url)) as worker:
            await consuming(amqp_url, channel)
            await delete_queues(amqp_url, delay_name(channel))
            await send(amqp_url, channel, (body(1), "k", {}))

            async def ran() -> list[str]:
                return calls

            await eventually(ran, timeout_s=15)
            assert worker.stats.deferred >= 1
    assert calls == ["k"]


async def test_dead_letters_sharing_a_message_id_settled_at_once_all_reach_the_dlq(
    amqp_url: str, channel: str
) -> None:
    """aiormq matches a return to its publish by message id: eight dead letters of one id,
    settled together after <channel>.dlq was deleted, all land in the declared-again DLQ."""
    messages = [(body(i), "same-id", {}) for i in range(8)]
    async with fetched(amqp_url, channel, *messages) as (_, deliveries):
        await delete_queues(amqp_url, dlq_name(channel))
        dead = Settlement(Action.DEAD_LETTER, reason=Reason.REJECTED, detail="not wanted")
        settled = await asyncio.gather(*(d.settle(dead) for d in deliveries))
    assert settled == [True] * 8
    assert await queued(amqp_url, dlq_name(channel)) == 8
    assert await queued(amqp_url, channel) == 0


async def test_a_dead_letter_that_cannot_be_routed_again_sends_its_original_back_to_the_queue(
    amqp_url: str, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The re-declaration fails (a queue of the channel was re-created with other arguments):
    the original is requeued, not acked, and its next delivery's dead letter gets through."""
    async with running(rejecting_app(channel), store, RabbitMQTransport(amqp_url)):
        await consuming(amqp_url, channel)
        await delete_queues(amqp_url, dlq_name(channel), delay_name(channel))
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            amqp = await connection.channel()
            await amqp.declare_queue(delay_name(channel), durable=True)  # no dead-letter routing
        await send(amqp_url, channel, (body(1), "k", {}))

        async def dead_lettered() -> int:
            return await queued(amqp_url, dlq_name(channel))

        await eventually(dead_lettered, timeout_s=15)
    assert await queued(amqp_url, dlq_name(channel)) == 1
    assert await queued(amqp_url, channel) == 0
    assert await db.fetchval("SELECT dead_lettered_at IS NOT NULL FROM dedupe_claims")


async def test_a_reply_to_a_missing_reply_queue_is_logged_and_the_request_still_acked(
    amqp_url: str, channel: str, store: ClaimStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The reply queue is the caller's: not declared for it; the outcome stays recorded."""
    runs: list[int] = []
    app = App("t")

    @app.handler(channel)
    async def quote(request: Job) -> dict[str, int]:
        runs.append(request.n)
        return {"n": request.n}

    connection = await aio_pika.connect(amqp_url)
    gone = f"t-gone-{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="dedupe_rabbitmq.transport")
    async with connection, running(app, store, RabbitMQTransport(amqp_url)) as worker:
        amqp = await connection.channel()
        await declare_channel(amqp, channel)
        await amqp.default_exchange.publish(
            aio_pika.Message(body(7), message_id="q-1", reply_to=gone), routing_key=channel
        )

        async def completed() -> int:
            return worker.stats.completed

        await eventually(completed, timeout_s=10)

        async def warned() -> bool:
            return any("reply" in r.getMessage() and gone in r.getMessage() for r in caplog.records)

        await eventually(warned, timeout_s=5)
    assert runs == [7]
    assert await queued(amqp_url, channel) == 0
    assert await queued(amqp_url, gone) == 0


async def test_a_replayed_dead_letter_whose_queue_is_gone_stays_in_the_dlq(
    amqp_url: str, channel: str
) -> None:
    """`dlq replay` publishes its copies `mandatory`: a copy RabbitMQ cannot route (the work
    queue was deleted while the replay ran) comes back, the replay stops with an error that
    says so, and the dead letter is still in <channel>.dlq, not acked into nothing."""
    from dedupe.errors import DedupeError
    from dedupe_rabbitmq.admin import peek_dead_letters, replay_dead_letters

    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        await declare_channel(amqp, channel)
    headers = {"x-dedupe-reason": "rejected", "x-dedupe-scope": "t.work", "x-dedupe-key": "k1"}
    await send(amqp_url, dlq_name(channel), (body(1), "k1", headers))

    async def release(scope: str, key: str) -> None:
        await delete_queues(amqp_url, channel)  # what an operator does meanwhile

    with pytest.raises(DedupeError, match=r"stays in .*dlq"):
        await replay_dead_letters(amqp_url, channel, limit=10, release=release)
    [left] = await peek_dead_letters(amqp_url, channel, limit=10)
    assert left["message_id"] == "k1"
