"""Copies of RabbitMQ deliveries (dead letters, deferrals, RPC replies) sent with confirms.

Copies go out `mandatory` on a confirming channel of their own opened with `on_return_raises`:
one RabbitMQ cannot route (the queue was deleted or expired) comes back instead of vanishing,
and the original is never acked into nothing. A slow confirm never holds up deliveries on the
consuming channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractRobustConnection,
)

from dedupe_rabbitmq.topology import declare_channel

logger = logging.getLogger(__name__)


class Copies:
    """Publishes copies on the transport's connection; `channel` is the confirming channel."""

    def __init__(self, connection: Callable[[], AbstractRobustConnection | None]) -> None:
        self._connection = connection  # the transport's, None once it is closed
        self.channel: AbstractChannel | None = None
        self._reopening = asyncio.Lock()
        self._copying: dict[str, asyncio.Event] = {}  # message ids with a copy in flight

    async def open(self) -> None:
        """Open the confirming channel on the transport's connection."""
        connection = self._connection()
        if connection is None:
            raise aio_pika.exceptions.ChannelInvalidStateError("the transport is closed")
        self.channel = await connection.channel(publisher_confirms=True, on_return_raises=True)

    async def copy(self, message: aio_pika.Message, channel: str, queue: str) -> bool:
        """Publish a copy to one of `channel`'s queues; False if RabbitMQ cannot route it.

        A copy RabbitMQ returns (the queue was deleted, or expired by a policy) or refuses
        makes the transport declare the channel's queues again and send it once more.
        """
        async with self._alone(message.message_id):
            try:
                await self._publish(message, queue)
                return True
            except aio_pika.exceptions.DeliveryError as exc:
                logger.warning(
                    "RabbitMQ did not take a copy for %s (%s); declaring the queues of %s again",
                    queue,
                    exc,
                    channel,
                )
            try:
                await self._declare_again(channel)
                await self._publish(message, queue)
                return True
            except (aio_pika.exceptions.DeliveryError, aio_pika.exceptions.AMQPChannelError) as exc:
                logger.warning("RabbitMQ still did not take a copy for %s (%s)", queue, exc)
                return False

    @contextlib.asynccontextmanager
    async def _alone(self, message_id: str | None) -> AsyncIterator[None]:
        """Hold other copies of this message id back until this one is confirmed or returned.

        aiormq matches a returned message to its publish by message id: with two copies of one
        id in flight, a return can land on the other copy, and the one RabbitMQ returned then
        counts as confirmed and is lost (seen with a real broker). Copies of one id seldom
        overlap (duplicates deferred together, one message id under several keys), so the wait
        costs little.
        """
        if message_id is None:
            yield  # aiormq gives the copy a random id of its own
            return
        while (busy := self._copying.get(message_id)) is not None:
            await busy.wait()
        self._copying[message_id] = done = asyncio.Event()
        try:
            yield
        finally:
            del self._copying[message_id]
            done.set()

    async def _declare_again(self, name: str) -> None:
        """Declare a channel's queues on a channel of their own, closed afterwards.

        A declaration RabbitMQ refuses (a queue re-created with other arguments) closes the
        channel it was made on; the copy channel carries the confirms of other copies.
        """
        connection = self._connection()
        if connection is None:
            raise aio_pika.exceptions.ChannelInvalidStateError("the transport is closed")
        channel = await connection.channel(publisher_confirms=False)
        try:
            await declare_channel(channel, name)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _publish(self, message: aio_pika.Message, routing_key: str) -> None:
        channel = self.channel
        if channel is None or channel.is_closed:
            channel = await self._reopen()
        # mandatory: a message RabbitMQ cannot route raises (on_return_raises) instead of
        # being confirmed and dropped.
        await channel.default_exchange.publish(message, routing_key=routing_key, mandatory=True)

    async def _reopen(self) -> AbstractChannel:
        """A new confirming channel for copies (dead letters, delays, replies).

        aio-pika restores a robust channel after a reconnect, except when the restore itself
        fails while the broker is still going down; then the channel stays closed for good
        and, without this, every later dead letter and deferral would fail (found by the
        chaos suite: poison messages redelivered forever after a RabbitMQ restart).
        """
        async with self._reopening:
            channel = self.channel
            if channel is None or channel.is_closed:
                connection = self._connection()
                if connection is None:
                    raise aio_pika.exceptions.ChannelInvalidStateError("the transport is closed")
                logger.info("reopening the channel for dead letters and delays")
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                self.channel = channel
            return channel

    async def reply(self, incoming: AbstractIncomingMessage, result: str) -> None:
        """Replay the stored outcome to a request-reply caller (RPC over RabbitMQ).

        The reply queue is the caller's, so it is never declared here. A reply RabbitMQ cannot
        route (the caller's queue is gone) is logged at warning and the request still acked:
        its outcome is recorded, and a caller that retries gets it as a duplicate's reply.
        """
        assert incoming.reply_to is not None
        reply = aio_pika.Message(
            result.encode(),
            content_type="application/json",
            correlation_id=incoming.correlation_id,
        )
        try:
            await self._publish(reply, incoming.reply_to)
        except aio_pika.exceptions.DeliveryError as exc:
            logger.warning(
                "RabbitMQ did not take the reply to %s (%s); the outcome stays recorded",
                incoming.reply_to,
                exc,
                extra={"message_id": incoming.message_id},
            )
