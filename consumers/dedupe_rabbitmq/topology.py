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

With `?queue_type=quorum` in the broker URL every one of them is a quorum queue (replicated
across the cluster) with an explicit delivery limit (dedupe_rabbitmq.options.DELIVERY_LIMIT),
and the ones that dead-letter (C, the delay queues) do so at least once. Per-message TTL on a
quorum queue needs RabbitMQ 3.10 or later.

The transport declares them on its aiormq channel (`declare_queues`), the operators' functions
and the publisher on aio-pika's (`declare_channel`): one table of queues for both. A queue that
exists with other arguments (a classic queue where a quorum one is asked for) is refused by
RabbitMQ; the error says what to do (`QueueMismatch`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
)
from aiormq.abc import AbstractChannel as AmqpChannel
from aiormq.exceptions import ChannelPreconditionFailed
from pamqp.commands import Basic

from dedupe.errors import ConfigurationError
from dedupe.transport import DELAY_BUCKETS, delay_bucket, dlq_name
from dedupe_rabbitmq.options import DEFAULT, RabbitOptions


def delay_name(channel: str, delay_s: float = 0.0) -> str:
    """The delay queue a deferral of `delay_s` waits in: the smallest bucket that covers it."""
    _, label = delay_bucket(delay_s)
    return f"{channel}.delay.{label}"


def delay_queues(channel: str) -> list[str]:
    """Every delay queue of a channel: the buckets, then the earlier versions' single one."""
    return [f"{channel}.delay.{label}" for _, label in DELAY_BUCKETS] + [f"{channel}.delay"]


def queues(name: str, options: RabbitOptions = DEFAULT) -> list[tuple[str, dict[str, Any] | None]]:
    """The channel's queues with their arguments, the work queue last."""
    back = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": name}
    dead = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq_name(name)}
    return [
        (dlq_name(name), options.arguments(dead_letters=False) or None),
        *(
            (delay, {**back, **options.arguments(dead_letters=True)})
            for delay in delay_queues(name)
        ),
        (name, {**dead, **options.arguments(dead_letters=True)}),
    ]


class QueueMismatch(ConfigurationError, ChannelPreconditionFailed):
    """A queue of the channel exists with other arguments than the URL asks for (its type,
    most often: RabbitMQ cannot turn a classic queue into a quorum one in place)."""

    def __init__(
        self, queue: str, channel: str, options: RabbitOptions, refusal: BaseException
    ) -> None:
        asked = options.queue_type
        other = "classic" if options.quorum else "quorum"
        said = str(refusal)
        exists = (
            f"it exists as a {other} queue"
            if "x-queue-type" in said
            else ("it exists with other arguments")
        )
        names = " ".join(name for name, _ in queues(channel))
        ConfigurationError.__init__(
            self,
            f"RabbitMQ refused to declare queue {queue!r} as a {asked} queue: {exists} "
            f"({said}). A queue's type and arguments cannot change in place. Either keep "
            f"queue_type={other} in the broker URL for channel {channel!r}, or move it to "
            f"{asked} queues: stop every worker, receiver and relay that uses the channel, let "
            f"{channel!r} drain (and replay or note what `dedupe-worker dlq list {channel}` "
            f"shows), delete the channel's queues ({names}: `rabbitmqctl delete_queue NAME` "
            f"for each), then start them all with queue_type={asked}; or shovel the messages "
            "to a new channel name.",
        )


async def declare_channel(
    channel: AbstractChannel, name: str, *, options: RabbitOptions = DEFAULT
) -> AbstractQueue:
    """Declare the work, dead-letter and delay queues of one channel; return the work queue."""
    *others, (work, arguments) = queues(name, options)
    for queue_name, queue_arguments in others:
        await _refused_as_mismatch(
            queue_name,
            name,
            options,
            channel.declare_queue(queue_name, durable=True, arguments=queue_arguments),
        )
    return await _refused_as_mismatch(
        work, name, options, channel.declare_queue(work, durable=True, arguments=arguments)
    )


async def declare_queues(
    channel: AmqpChannel, name: str, *, options: RabbitOptions = DEFAULT
) -> None:
    """Declare the work, dead-letter and delay queues of one channel on an aiormq channel."""
    for queue_name, arguments in queues(name, options):
        await _refused_as_mismatch(
            queue_name,
            name,
            options,
            channel.queue_declare(queue_name, durable=True, arguments=arguments),
        )


T = TypeVar("T")


async def _refused_as_mismatch(
    queue: str, channel: str, options: RabbitOptions, declare: Awaitable[T]
) -> T:
    try:
        return await declare
    except ChannelPreconditionFailed as exc:
        if "inequivalent arg" in str(exc):
            raise QueueMismatch(queue, channel, options, exc) from exc
        raise


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
