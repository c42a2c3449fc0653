"""RabbitMQ for operators and tests: peek at and replay dead letters, publish, delete queues."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import DeliveryError

from dedupe.errors import DedupeError
from dedupe.operations.replay import Release, ReplayPolicy, describe
from dedupe.transport import DEFERRALS_HEADER, dlq_name
from dedupe_rabbitmq.connection import connect
from dedupe_rabbitmq.options import BrokerUrl
from dedupe_rabbitmq.topology import copy_of, declare_channel, delay_queues

logger = logging.getLogger(__name__)

# The transport adds the deferral count besides the dead-letter headers; a replay strips both.
REPLAY = ReplayPolicy(own_headers=(DEFERRALS_HEADER,))
CONNECT_TIMEOUT_S = 10.0


async def peek_dead_letters(url: str, channel: str, *, limit: int) -> list[dict[str, Any]]:
    """Read up to `limit` dead letters without removing them (they return on close)."""
    found: list[dict[str, Any]] = []
    connection = await connect(url, aio_pika.connect, timeout_s=CONNECT_TIMEOUT_S)
    async with connection:
        amqp = await connection.channel()
        queue = await declare_channel(amqp, channel, options=BrokerUrl.parse(url).options)
        dlq = await amqp.get_queue(dlq_name(queue.name))
        for _ in range(limit):
            incoming = await dlq.get(no_ack=False, fail=False, timeout=5)
            if incoming is None:
                break
            row = describe(incoming.headers or {}, message_id=incoming.message_id)
            found.append({**row, "bytes": len(incoming.body)})
        # Closing the channel returns every unacknowledged message to the queue, in order.
    return found


async def replay_dead_letters(
    url: str, channel: str, *, limit: int, release: Release | None = None
) -> list[dict[str, Any]]:
    """Move up to `limit` dead letters back to their channel (confirmed before removal).

    What goes back, and which failed claim `release(scope, key)` frees before the copy is
    published, is dedupe.operations.replay's policy; a dead letter it skips stays in <channel>.dlq.
    Copies go out `mandatory`: one RabbitMQ cannot route (the queue was deleted meanwhile)
    comes back, its dead letter stays, and the replay stops with an error saying so.
    """
    moved: list[dict[str, Any]] = []
    connection = await connect(url, aio_pika.connect, timeout_s=CONNECT_TIMEOUT_S)
    async with connection:
        amqp = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await declare_channel(amqp, channel, options=BrokerUrl.parse(url).options)
        dlq = await amqp.get_queue(dlq_name(channel))
        for _ in range(limit):
            incoming = await dlq.get(no_ack=False, fail=False, timeout=5)
            if incoming is None:
                break
            step = REPLAY.plan(dict(incoming.headers or {}), message_id=incoming.message_id)
            if step.skipped is not None:
                # Left unacknowledged: closing the channel puts it back in the queue.
                logger.warning(
                    "not replaying %s from %s: %s",
                    incoming.message_id,
                    dlq_name(channel),
                    step.skipped,
                )
                continue

            async def republish(
                headers: dict[str, Any], incoming: AbstractIncomingMessage = incoming
            ) -> None:
                await amqp.default_exchange.publish(
                    copy_of(incoming, headers=headers), channel, mandatory=True
                )

            try:
                await step.carry_out(release=release, republish=republish)
            except DeliveryError as exc:
                # Returned unrouted (or nacked): the dead letter is not acked, so closing the
                # channel puts it back in the queue.
                raise DedupeError(
                    f"RabbitMQ did not take the copy of {incoming.message_id} for queue "
                    f"{channel!r} ({exc}; was the queue deleted meanwhile?): it stays "
                    f"in {dlq_name(channel)}; {len(moved)} dead letter(s) were replayed before "
                    "it. Run the replay again once the queue exists."
                ) from exc
            moved.append(step.row)
            await incoming.ack()
    return moved


async def publish(
    url: str, channel: str, messages: Sequence[tuple[bytes, dict[str, Any], str | None]]
) -> int:
    """Publish (body, headers, message_id) triples with confirms, `mandatory` (one RabbitMQ
    cannot route raises aiormq's DeliveryError); declares the channel first."""
    connection = await connect(url, aio_pika.connect, timeout_s=CONNECT_TIMEOUT_S)
    async with connection:
        amqp = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await declare_channel(amqp, channel, options=BrokerUrl.parse(url).options)
        pending = [
            amqp.default_exchange.publish(
                aio_pika.Message(
                    body,
                    headers=headers,
                    message_id=message_id,
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=channel,
                mandatory=True,
            )
            for body, headers, message_id in messages
        ]
        for start in range(0, len(pending), 500):
            await asyncio.gather(*pending[start : start + 500])
    return len(messages)


async def delete_channels(url: str, channels: Iterable[str]) -> int:
    """Delete each channel's queues (C, its delay queues, C.dlq) with whatever they hold.

    For tests, benchmarks and operators tidying up channels that are gone; missing queues are
    no error. Returns how many queue names were deleted.
    """
    names = [n for c in channels for n in (c, *delay_queues(c), dlq_name(c))]
    connection = await connect(url, aio_pika.connect, timeout_s=CONNECT_TIMEOUT_S)
    async with connection:
        amqp = await connection.channel()
        for name in names:
            await amqp.queue_delete(name)  # RabbitMQ answers delete-ok for a missing queue too
    return len(names)


class RabbitMQAdmin:
    """The operator's client for one RabbitMQ URL (dedupe.plugins.BrokerAdmin)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def peek_dead_letters(self, channel: str, *, limit: int) -> list[dict[str, Any]]:
        return await peek_dead_letters(self.url, channel, limit=limit)

    async def replay_dead_letters(
        self, channel: str, *, limit: int, release: Release | None = None
    ) -> list[dict[str, Any]]:
        return await replay_dead_letters(self.url, channel, limit=limit, release=release)

    async def publish(
        self, channel: str, messages: Sequence[tuple[bytes, Mapping[str, Any], str | None]]
    ) -> int:
        return await publish(self.url, channel, [(b, dict(h), m) for b, h, m in messages])

    async def delete_channels(self, channels: Sequence[str]) -> int:
        return await delete_channels(self.url, channels)
