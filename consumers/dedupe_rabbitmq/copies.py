"""Copies of RabbitMQ deliveries (dead letters, deferrals, RPC replies) sent with confirms.

Copies go out `mandatory` on a confirming aiormq channel of their own opened with
`on_return_raises`: one RabbitMQ cannot route (the queue was deleted or expired) comes back
instead of vanishing, and the original is never acked into nothing. A slow confirm never holds
up deliveries on the consuming channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiormq.abc import AbstractChannel, AbstractConnection
from aiormq.exceptions import AMQPChannelError, ChannelInvalidStateError, DeliveryError
from pamqp.commands import Basic

from dedupe_rabbitmq.options import DEFAULT, RabbitOptions
from dedupe_rabbitmq.topology import declare_queues

logger = logging.getLogger(__name__)


class Copies:
    """Publishes copies on the transport's connection; `channel` is the confirming channel."""

    # A publish through a connection whose socket died can wait for good (for room in aiormq's
    # frame queue, or a confirm): past this, the settlement fails and the broker redelivers.
    PUBLISH_TIMEOUT_S = 30.0

    def __init__(
        self,
        connection: Callable[[], AbstractConnection | None],
        options: RabbitOptions = DEFAULT,
    ) -> None:
        self._connection = connection  # the transport's current one, None once it is closed
        self.options = options  # the queue type the channel's queues are declared with
        self.channel: AbstractChannel | None = None
        self._reopening = asyncio.Lock()
        self._copying: dict[str, asyncio.Event] = {}  # message ids with a copy in flight

    def _open_connection(self) -> AbstractConnection:
        connection = self._connection()
        if connection is None or connection.is_closed:
            # A lost connection: the transport opens a new one (and then this channel again).
            raise ChannelInvalidStateError("the transport's connection is closed")
        return connection

    async def open(self) -> None:
        """Open the confirming channel on the transport's (new) connection."""
        async with self._reopening:
            self.channel = await self._open_connection().channel(
                publisher_confirms=True, on_return_raises=True
            )

    async def copy(
        self, body: bytes, properties: Basic.Properties, channel: str, queue: str
    ) -> bool:
        """Publish a copy to one of `channel`'s queues; False if RabbitMQ cannot route it.

        A copy RabbitMQ returns (the queue was deleted, or expired by a policy) or refuses
        makes the transport declare the channel's queues again and send it once more.
        """
        async with self._alone(properties.message_id):
            try:
                await self._publish(body, properties, queue)
                return True
            except DeliveryError as exc:
                logger.warning(
                    "RabbitMQ did not take a copy for %s (%s); declaring the queues of %s again",
                    queue,
                    exc,
                    channel,
                )
            try:
                await self._declare_again(channel)
                await self._publish(body, properties, queue)
                return True
            except (DeliveryError, AMQPChannelError) as exc:
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
        channel = await self._open_connection().channel(publisher_confirms=False)
        try:
            await declare_queues(channel, name, options=self.options)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _publish(self, body: bytes, properties: Basic.Properties, routing_key: str) -> None:
        channel = self.channel
        if channel is None or channel.is_closed:
            channel = await self._reopen()
        # mandatory: a message RabbitMQ cannot route raises (on_return_raises) instead of
        # being confirmed and dropped; a nack raises DeliveryError too.
        await channel.basic_publish(
            body,
            routing_key=routing_key,
            properties=properties,
            mandatory=True,
            timeout=self.PUBLISH_TIMEOUT_S,
        )

    async def _reopen(self) -> AbstractChannel:
        """A new confirming channel for copies (dead letters, delays, replies), once the last
        one was closed (by the broker, or with its connection, when the transport reconnects)."""
        async with self._reopening:
            channel = self.channel
            if channel is None or channel.is_closed:
                connection = self._open_connection()
                logger.info("reopening the channel for dead letters and delays")
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                self.channel = channel
            return channel

    async def reply(self, request: Basic.Properties, body: bytes, headers: dict[str, str]) -> None:
        """Replay the stored outcome to a request-reply caller (RPC over RabbitMQ), or a fault
        reply with its headers (dedupe.transport.reply_of).

        The reply queue is the caller's, so it is never declared here. A reply RabbitMQ cannot
        route (the caller's queue is gone) is logged at warning and the request still acked:
        its outcome is recorded, and a caller that retries gets it as a duplicate's reply.
        """
        assert request.reply_to is not None
        reply = Basic.Properties(
            content_type="application/json",
            correlation_id=request.correlation_id,
            delivery_mode=1,
            headers=dict(headers) or None,
        )
        try:
            await self._publish(body, reply, request.reply_to)
        except DeliveryError as exc:
            logger.warning(
                "RabbitMQ did not take the reply to %s (%s); the outcome stays recorded",
                request.reply_to,
                exc,
                extra={"message_id": request.message_id},
            )
