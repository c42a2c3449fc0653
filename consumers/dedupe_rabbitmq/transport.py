"""RabbitMQ transport on aio-pika: consume channels, settle deliveries as the core decides.

A robust connection, manual acks (in runs, dedupe_rabbitmq.acks) only after the outcome is
recorded; dead letters and deferrals are copies to the channel's queues
(dedupe_rabbitmq.topology) sent with confirms (dedupe_rabbitmq.copies). The operators'
functions and the receiver's publisher live in dedupe_rabbitmq.admin and .publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from dedupe.message import Headers, Message
from dedupe.transport import (
    Action,
    Delivery,
    Process,
    Settlement,
    Transport,
    dead_letter_headers,
    dlq_name,
)
from dedupe_rabbitmq.acks import Acks
from dedupe_rabbitmq.copies import Copies
from dedupe_rabbitmq.topology import DEFERRALS_HEADER, copy_of, declare_channel, delay_name

logger = logging.getLogger(__name__)


class RabbitDelivery:
    """One aio-pika delivery, settled through the transport's confirming channel."""

    __slots__ = ("_message", "channel", "incoming", "transport")

    def __init__(
        self, transport: RabbitMQTransport, channel: str, incoming: AbstractIncomingMessage
    ) -> None:
        self.transport = transport
        self.channel = channel
        self.incoming = incoming
        self._message: Message | None = None

    @property
    def message(self) -> Message:
        if self._message is None:
            headers = Headers(self.incoming.headers or {})
            try:
                deferrals = int(headers.get(DEFERRALS_HEADER, "0"))
            except ValueError:
                deferrals = 0
            self._message = Message(
                channel=self.channel,
                body=self.incoming.body,
                headers=headers,
                message_id=self.incoming.message_id,
                attempt=deferrals + 1,
                content_type=self.incoming.content_type,
                meta={"redelivered": bool(self.incoming.redelivered)},
            )
        return self._message

    async def settle(self, settlement: Settlement) -> bool:
        try:
            return await self.transport.settle(self, settlement)
        except Exception as exc:
            # The connection went away: the broker redelivers the message, and the claim
            # table turns that redelivery into a duplicate (or a take-over after the lease).
            logger.warning(
                "could not settle a delivery on %s (%s): the broker will redeliver it",
                self.channel,
                exc,
            )
            return False


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("processing a batch failed", exc_info=task.exception())


class RabbitMQTransport(Transport):
    """Consume channels from RabbitMQ and settle deliveries as the core decides."""

    WATCH_S = 5.0  # how often the consuming channel is looked at (see _watch)
    # How long a delivery whose copy RabbitMQ would not route waits before it is requeued, so
    # that a queue that cannot be declared (missing permission, other arguments) does not
    # spin the message through the worker as fast as the broker redelivers it.
    UNROUTABLE_PAUSE_S = 1.0

    def __init__(
        self,
        url: str,
        *,
        prefetch: int = 64,
        batch_max: int = 64,
        connection_name: str = "dedupe-worker",
    ) -> None:
        self.url = url
        self.connection_name = connection_name  # shown by rabbitmqctl and the management UI
        self.prefetch = prefetch
        self.batch_max = batch_max
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._acks = Acks()
        self.copies = Copies(lambda: self._connection)

    async def connect(self) -> None:
        if self._connection is None:
            self._connection = await aio_pika.connect_robust(
                self.url, timeout=10, client_properties={"connection_name": self.connection_name}
            )
            self._channel = await self._connection.channel()
            await self._channel.set_qos(prefetch_count=self.prefetch)
            await self.copies.open()

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()

    async def serve(self, channels: Sequence[str], process: Process, stop: asyncio.Event) -> None:
        await self.connect()
        assert self._channel is not None
        inboxes: dict[str, asyncio.Queue[AbstractIncomingMessage]] = {
            name: asyncio.Queue() for name in channels
        }
        consumers = await self._consume(self._channel, inboxes)
        logger.info("consuming %s (prefetch %d)", ", ".join(channels), self.prefetch)
        processing: set[asyncio.Task[None]] = set()
        dispatchers = [
            asyncio.create_task(
                self._dispatch(name, inbox, process, processing), name=f"dispatch-{name}"
            )
            for name, inbox in inboxes.items()
        ]
        watchdog = asyncio.create_task(self._watch(inboxes, consumers), name="rabbitmq-watchdog")
        try:
            await stop.wait()
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
            for queue, tag in consumers:
                with contextlib.suppress(Exception):
                    await queue.cancel(tag)
            for task in dispatchers:
                task.cancel()
            await asyncio.gather(*dispatchers, return_exceptions=True)
            # Deliveries that reached us but were never started go straight back.
            for inbox in inboxes.values():
                while not inbox.empty():
                    incoming = inbox.get_nowait()
                    self._acks.forget(incoming)
                    with contextlib.suppress(Exception):
                        await incoming.nack(requeue=True)
            if processing:
                await asyncio.gather(*processing, return_exceptions=True)
            await self._acks.drain()

    async def _consume(
        self,
        channel: AbstractChannel,
        inboxes: Mapping[str, asyncio.Queue[AbstractIncomingMessage]],
    ) -> list[tuple[AbstractQueue, str]]:
        """Declare each channel's queues and consume them into its inbox."""
        consumers: list[tuple[AbstractQueue, str]] = []
        for name, inbox in inboxes.items():
            queue = await declare_channel(channel, name)

            async def arrived(
                incoming: AbstractIncomingMessage,
                inbox: asyncio.Queue[AbstractIncomingMessage] = inbox,
            ) -> None:
                self._acks.delivered(incoming)
                inbox.put_nowait(incoming)

            tag = await queue.consume(arrived, no_ack=False)
            consumers.append((queue, tag))
        return consumers

    async def _watch(
        self,
        inboxes: Mapping[str, asyncio.Queue[AbstractIncomingMessage]],
        consumers: list[tuple[AbstractQueue, str]],
    ) -> None:
        """Consume again on a new channel when the consuming one stays closed.

        aio-pika restores channels after a reconnect, except when the restore itself fails
        (the broker still going down); the channel then stays closed while the connection is
        up, and without this the worker would sit idle for good. Two looks WATCH_S apart, so
        a restore in progress is left to finish.
        """
        closed_before = False
        while True:
            await asyncio.sleep(self.WATCH_S)
            connection, channel = self._connection, self._channel
            if connection is None or channel is None:
                return
            if not channel.is_closed or not connection.connected.is_set():
                closed_before = False
                continue
            if not closed_before:
                closed_before = True
                continue
            logger.warning("the consuming channel stayed closed; consuming on a new one")
            try:
                fresh = await connection.channel()
                await fresh.set_qos(prefetch_count=self.prefetch)
                consumers[:] = await self._consume(fresh, inboxes)
            except Exception as exc:
                logger.warning("could not consume on a new channel yet (%s); retrying", exc)
                continue
            self._channel, closed_before = fresh, False

    async def _dispatch(
        self,
        name: str,
        inbox: asyncio.Queue[AbstractIncomingMessage],
        process: Process,
        processing: set[asyncio.Task[None]],
    ) -> None:
        """Hand whatever has arrived to the core as one batch (one claim statement)."""
        while True:
            batch = [await inbox.get()]
            while len(batch) < self.batch_max and not inbox.empty():
                batch.append(inbox.get_nowait())
            deliveries: list[Delivery] = [RabbitDelivery(self, name, m) for m in batch]
            task = asyncio.create_task(process(name, deliveries))
            processing.add(task)
            task.add_done_callback(processing.discard)
            task.add_done_callback(_log_failure)

    async def settle(self, delivery: RabbitDelivery, settlement: Settlement) -> bool:
        """Carry out the settlement; False when a copy could not be routed and the delivery
        was requeued instead (a dead letter then is not sent: its next delivery sends it)."""
        incoming = delivery.incoming
        if settlement.action is Action.ACK:
            if settlement.result is not None and incoming.reply_to:
                await self.copies.reply(incoming, settlement.result)
            await self._ack(incoming)
        elif settlement.action is Action.DEAD_LETTER:
            headers: dict[str, Any] = dict(incoming.headers or {})
            headers.update(dead_letter_headers(settlement))
            dead_letter = copy_of(incoming, headers=headers)
            if not await self.copies.copy(
                dead_letter, delivery.channel, dlq_name(delivery.channel)
            ):
                return await self._give_back(incoming, dlq_name(delivery.channel))
            await self._ack(incoming)
            logger.warning(
                "dead-lettered a message from %s to %s: %s (%s)",
                delivery.channel,
                dlq_name(delivery.channel),
                settlement.reason,
                settlement.detail,
                extra={
                    "channel": delivery.channel,
                    "scope": settlement.scope,
                    "key": settlement.key,
                    "message_id": incoming.message_id,
                    "reason": str(settlement.reason),
                    "outcome": str(settlement.action),
                },
            )
        elif settlement.action is Action.DEFER or settlement.delay_s > 0:
            headers = dict(incoming.headers or {})
            if settlement.action is Action.DEFER:
                headers[DEFERRALS_HEADER] = delivery.message.attempt
            delay = max(settlement.delay_s, 0.05)
            later = copy_of(incoming, headers=headers, expiration=delay)
            if not await self.copies.copy(later, delivery.channel, delay_name(delivery.channel)):
                return await self._give_back(incoming, delay_name(delivery.channel))
            await self._ack(incoming)
        else:
            self._acks.forget(incoming)
            await incoming.nack(requeue=True)
        return True

    async def _give_back(self, incoming: AbstractIncomingMessage, queue: str) -> bool:
        """Requeue a delivery whose copy RabbitMQ would not route, rather than ack it."""
        logger.warning(
            "no way to route a copy to %s; the message goes back to its queue",
            queue,
            extra={"message_id": incoming.message_id},
        )
        self._acks.forget(incoming)
        await asyncio.sleep(self.UNROUTABLE_PAUSE_S)
        await incoming.nack(requeue=True)
        return False

    async def _ack(self, incoming: AbstractIncomingMessage) -> None:
        """Acknowledge, in a run with the deliveries settled beside it (one frame for many)."""
        if incoming.channel.is_closed:
            self._acks.forget(incoming)
            raise aio_pika.exceptions.ChannelInvalidStateError("the channel is closed")
        if not self._acks.ack(incoming):
            await incoming.ack()


__all__ = ["RabbitDelivery", "RabbitMQTransport"]
