"""A channel's queues on RabbitMQ, and the persistent copies of deliveries sent to them.

Topology per channel `C` (all durable):
  C          the work queue; rejected messages dead-letter to C.dlq through the default exchange
  C.dlq      dead letters, with the reason in `x-dedupe-reason` / `x-dedupe-detail` headers
  C.delay    no consumers: deferred messages wait out their per-message TTL, then return to C
"""

from __future__ import annotations

from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
)

from dedupe.transport import dlq_name

# How many times a message was deferred (the delivery's attempt is one more).
DEFERRALS_HEADER = "x-dedupe-deferrals"


def delay_name(channel: str) -> str:
    return f"{channel}.delay"


async def declare_channel(channel: AbstractChannel, name: str) -> AbstractQueue:
    """Declare the work, dead-letter and delay queues of one channel; return the work queue."""
    await channel.declare_queue(dlq_name(name), durable=True)
    await channel.declare_queue(
        delay_name(name),
        durable=True,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name},
    )
    return await channel.declare_queue(
        name,
        durable=True,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq_name(name)},
    )


def copy_of(
    incoming: AbstractIncomingMessage,
    *,
    headers: dict[str, Any] | None = None,
    expiration: float | None = None,
) -> aio_pika.Message:
    """A persistent copy of a delivery, for the dead-letter or delay queue."""
    return aio_pika.Message(
        incoming.body,
        headers=headers if headers is not None else dict(incoming.headers or {}),
        content_type=incoming.content_type,
        content_encoding=incoming.content_encoding,
        message_id=incoming.message_id,
        correlation_id=incoming.correlation_id,
        reply_to=incoming.reply_to,
        timestamp=incoming.timestamp,
        type=incoming.type,
        app_id=incoming.app_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        expiration=expiration,
    )
