"""A channel's queues on RabbitMQ, and the persistent copies of deliveries sent to them.

Topology per channel `C` (all durable, bound to the default exchange by name):
  C          the work queue; rejected messages dead-letter to C.dlq through the default exchange
  C.dlq      dead letters, with the reason in `x-dedupe-reason` / `x-dedupe-detail` headers
  C.delay.5s, C.delay.30s, C.delay.2m, C.delay.10m, C.delay.1h
             no consumers: a deferred message waits out its per-message TTL in the smallest
             bucket whose bound covers its delay, then returns to C. RabbitMQ expires messages
             only at a queue's head, so one queue for every delay would hold a 5 s deferral
             behind a 1 h one; per bucket, a message waits at most behind others of its bucket
             (longer than the bound: the last bucket)
  C.delay    the single delay queue of earlier versions, still declared so that what waits
             in it comes back

The transport declares them on its aiormq channel (`declare_queues`), the operators' functions
and the publisher on aio-pika's (`declare_channel`): one table of queues for both.
"""

from __future__ import annotations

from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
)
from aiormq.abc import AbstractChannel as AmqpChannel
from pamqp.commands import Basic

from dedupe.transport import dlq_name

# How many times a message was deferred (the delivery's attempt is one more).
DEFERRALS_HEADER = "x-dedupe-deferrals"


# (bound in seconds, label): the delay buckets, shortest first.
DELAY_BUCKETS: tuple[tuple[float, str], ...] = (
    (5.0, "5s"),
    (30.0, "30s"),
    (120.0, "2m"),
    (600.0, "10m"),
    (3600.0, "1h"),
)


def delay_name(channel: str, delay_s: float = 0.0) -> str:
    """The delay queue a deferral of `delay_s` waits in: the smallest bucket that covers it."""
    label = next((label for bound, label in DELAY_BUCKETS if delay_s <= bound), "1h")
    return f"{channel}.delay.{label}"


def delay_queues(channel: str) -> list[str]:
    """Every delay queue of a channel: the buckets, then the earlier versions' single one."""
    return [f"{channel}.delay.{label}" for _, label in DELAY_BUCKETS] + [f"{channel}.delay"]


def queues(name: str) -> list[tuple[str, dict[str, Any] | None]]:
    """The channel's queues with their arguments, the work queue last."""
    return [
        (dlq_name(name), None),
        *(
            (delay, {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name})
            for delay in delay_queues(name)
        ),
        (name, {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq_name(name)}),
    ]


async def declare_channel(channel: AbstractChannel, name: str) -> AbstractQueue:
    """Declare the work, dead-letter and delay queues of one channel; return the work queue."""
    *others, (work, arguments) = queues(name)
    for queue_name, queue_arguments in others:
        await channel.declare_queue(queue_name, durable=True, arguments=queue_arguments)
    return await channel.declare_queue(work, durable=True, arguments=arguments)


async def declare_queues(channel: AmqpChannel, name: str) -> None:
    """Declare the work, dead-letter and delay queues of one channel on an aiormq channel."""
    for queue_name, arguments in queues(name):
        await channel.queue_declare(queue_name, durable=True, arguments=arguments)


def copy_of(
    incoming: AbstractIncomingMessage,
    *,
    headers: dict[str, Any] | None = None,
    expiration: float | None = None,
) -> aio_pika.Message:
    """A persistent copy of an aio-pika delivery (the operators' replay)."""
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


def copy_properties(
    properties: Basic.Properties,
    *,
    headers: dict[str, Any] | None = None,
    expiration_s: float | None = None,
) -> Basic.Properties:
    """The properties of a persistent copy of a delivered frame, for the dead-letter or delay
    queue: the same fields `copy_of` keeps (not user_id, which RabbitMQ checks against the
    connection's user, nor priority)."""
    return Basic.Properties(
        content_type=properties.content_type,
        content_encoding=properties.content_encoding,
        headers=headers if headers is not None else dict(properties.headers or {}),
        delivery_mode=2,
        correlation_id=properties.correlation_id,
        reply_to=properties.reply_to,
        expiration=None if expiration_s is None else str(int(expiration_s * 1000)),
        message_id=properties.message_id,
        timestamp=properties.timestamp,
        message_type=properties.message_type,
        app_id=properties.app_id,
    )
