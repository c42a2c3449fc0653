"""RabbitMQ transport on aiormq: consume channels, settle deliveries as the core decides.

One aiormq connection: a consuming channel whose deliveries go from the frame reader straight
into an inbox per channel (no aio-pika message and no task per delivery), handed to the core in
batches; manual acks (in runs, dedupe_rabbitmq.acks) only after the outcome is recorded; dead
letters and deferrals are copies to the channel's queues (dedupe_rabbitmq.topology) sent with
confirms on a second channel (dedupe_rabbitmq.copies). A lost connection or consuming channel
is opened again with backoff, the queues declared again, the prefetch set and the queues
consumed again: what aio-pika's `connect_robust` did. The operators' functions and the
receiver's publisher (aio-pika) live in dedupe_rabbitmq.admin and .publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import aiormq
from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage
from aiormq.exceptions import ChannelInvalidStateError
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from dedupe.errors import ConfigurationError
from dedupe.message import Headers, Message
from dedupe.transport import (
    DEFERRALS_HEADER,
    Action,
    Delivery,
    Process,
    Settlement,
    Transport,
    dead_letter_headers,
    dlq_name,
    reply_of,
)
from dedupe_rabbitmq.acks import Acks
from dedupe_rabbitmq.connection import connect as connect_nodes
from dedupe_rabbitmq.copies import Copies
from dedupe_rabbitmq.options import BrokerUrl
from dedupe_rabbitmq.topology import copy_properties, declare_queues, delay_name

logger = logging.getLogger(__name__)

# What a channel or connection lost under a statement raises (then: consume again)...
_LOST = (
    aiormq.exceptions.ChannelClosed,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ConnectionClosed,
)
# ...except the broker's refusals, which close the channel too (ChannelClosed's subclasses):
# declaring again gets the same answer, so they are the start's error (topology.QueueMismatch,
# a ConfigurationError, says what to do about a queue of another type).
_REFUSED = (
    ConfigurationError,
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelLockedResource,
    aiormq.exceptions.ChannelPreconditionFailed,
)

# The frame's properties put into Message.meta when set (the rest have Message fields).
_META_PROPERTIES = (
    ("correlation_id", "correlation_id"),
    ("reply_to", "reply_to"),
    ("timestamp", "timestamp"),
    ("message_type", "type"),
    ("app_id", "app_id"),
    ("user_id", "user_id"),
    ("priority", "priority"),
    ("expiration", "expiration"),
    ("content_encoding", "content_encoding"),
    ("delivery_mode", "delivery_mode"),
)


class RabbitDelivery:
    """One delivered frame, settled through the transport (its acks and confirming channel)."""

    __slots__ = ("_message", "channel", "frame", "transport")
    # A queue's deliveries are never taken back while they run (see dedupe.transport.Delivery);
    # a class attribute, so that the core reads it without an AttributeError per run.
    withdrawn = False

    def __init__(self, transport: RabbitMQTransport, channel: str, frame: DeliveredMessage) -> None:
        self.transport = transport
        self.channel = channel
        self.frame = frame
        self._message: Message | None = None

    @property
    def message(self) -> Message:
        if self._message is None:
            frame = self.frame
            properties = frame.header.properties
            headers = Headers(properties.headers)
            try:
                deferrals = int(headers.get(DEFERRALS_HEADER, "0"))
            except ValueError:
                deferrals = 0
            delivery = _deliver(frame)
            meta: dict[str, Any] = {
                "redelivered": bool(delivery.redelivered),
                "exchange": delivery.exchange,
                "routing_key": delivery.routing_key,
                "delivery_tag": delivery.delivery_tag,
            }
            for attribute, name in _META_PROPERTIES:
                value = getattr(properties, attribute)
                if value is not None:
                    meta[name] = value
            self._message = Message(
                channel=self.channel,
                body=frame.body,
                headers=headers,
                message_id=properties.message_id,
                attempt=deferrals + 1,
                content_type=properties.content_type,
                meta=meta,
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


def _deliver(frame: DeliveredMessage) -> Basic.Deliver:
    """The frame's Basic.Deliver (a consumer's deliveries are never a get or a return)."""
    return cast(Basic.Deliver, frame.delivery)


def _tag(frame: DeliveredMessage) -> int:
    return _deliver(frame).delivery_tag or 0  # the broker numbers deliveries from 1


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("processing a batch failed", exc_info=task.exception())


def _deliver_from_the_reader(
    channel: AbstractChannel, arrived: Callable[[DeliveredMessage], None]
) -> None:
    """Have the channel's frame reader hand each delivery to `arrived` itself.

    aiormq runs a consumer callback in a task of its own per delivery (a task, a wrapper and
    a future store entry for each message, about a third of a no-op message's cost in the
    transport). Its reader looks `_on_deliver_frame` up on the channel for every Deliver
    frame; this one reads the content the same way and calls `arrived`, which only queues the
    frame. Where an aiormq does not have these methods, the consumer callback given to
    basic_consume still delivers (with its task).
    """
    get_frame = getattr(channel, "_get_frame", None)
    read_content = getattr(channel, "_read_content", None)
    if not (
        callable(get_frame)
        and callable(read_content)
        and callable(getattr(channel, "_on_deliver_frame", None))
    ):
        return

    async def on_deliver_frame(frame: Basic.Deliver) -> None:
        header = await get_frame()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"unexpected frame {header!r} instead of a content header")
        arrived(await read_content(frame, header))

    # The instance attribute shadows the method for this channel only.
    setattr(channel, "_on_deliver_frame", on_deliver_frame)  # noqa: B010


class _Inbox:
    """Deliveries of one channel that arrived and wait for the next batch."""

    __slots__ = ("frames", "ready")

    def __init__(self) -> None:
        self.frames: deque[DeliveredMessage] = deque()
        self.ready = asyncio.Event()

    def put(self, frame: DeliveredMessage) -> None:
        self.frames.append(frame)
        if not self.ready.is_set():
            self.ready.set()


class RabbitMQTransport(Transport):
    """Consume channels from RabbitMQ and settle deliveries as the core decides."""

    CONNECT_TIMEOUT_S = 10.0
    # Reconnect backoff after a lost connection: the first try at once, then doubling.
    RECONNECT_MIN_S = 0.25
    RECONNECT_MAX_S = 5.0
    # How long a delivery whose copy RabbitMQ would not route waits before it is requeued, so
    # that a queue that cannot be declared (missing permission, other arguments) does not
    # spin the message through the worker as fast as the broker redelivers it.
    UNROUTABLE_PAUSE_S = 1.0
    # The longest a batch gathers deliveries while `batches_in_flight` batches run (_dispatch).
    GATHER_S = 0.005

    def __init__(
        self,
        url: str,
        *,
        prefetch: int = 256,  # Settings.effective_prefetch at the default concurrency
        batch_max: int = 256,
        connection_name: str = "dedupe-worker",
    ) -> None:
        self.url = url
        self.options = BrokerUrl.parse(url).options  # ?queue_type=, checked before connecting
        self.connection_name = connection_name  # shown by rabbitmqctl and the management UI
        self.prefetch = prefetch
        self.batch_max = batch_max
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None  # the consuming channel
        self._closed = False
        self._acks = Acks()
        self._inboxes: dict[str, _Inbox] = {}
        self._routes: dict[str, _Inbox] = {}  # consumer tag -> inbox, of the consuming channel
        self.reconnects = 0  # connections opened again after a loss (for logs and tests)
        self.copies = Copies(self._current_connection, self.options)

    def _current_connection(self) -> AbstractConnection | None:
        return None if self._closed else self._connection

    async def connect(self) -> None:
        """Open the connection and the channel for copies unless they are open."""
        self._closed = False
        if self._connection is None or self._connection.is_closed:
            # The URL's nodes in order: after a lost node, the next one that answers.
            self._connection = await connect_nodes(
                self.url,
                aiormq.connect,
                timeout_s=self.CONNECT_TIMEOUT_S,
                client_properties={"connection_name": self.connection_name},
            )
            async with asyncio.timeout(self.CONNECT_TIMEOUT_S):
                await self.copies.open()

    async def close(self) -> None:
        self._closed = True
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            # Bounded: the close handshake waits for the broker's answer.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.CONNECT_TIMEOUT_S):
                    await connection.close()

    async def serve(self, channels: Sequence[str], process: Process, stop: asyncio.Event) -> None:
        await self.connect()
        self._inboxes = {name: _Inbox() for name in channels}
        try:
            await self._consume()
        except _REFUSED:
            raise
        except _LOST as exc:
            # The channel or the connection went away while the queues were being declared
            # (a broker restarting, a channel closed): consume again as after any loss, with
            # backoff, rather than fail the start.
            logger.warning("lost RabbitMQ while starting to consume (%r); consuming again", exc)
            await self._restore()
        logger.info("consuming %s (prefetch %d)", ", ".join(channels), self.prefetch)
        processing: set[asyncio.Task[None]] = set()
        dispatchers = [
            asyncio.create_task(
                self._dispatch(name, inbox, process, processing), name=f"dispatch-{name}"
            )
            for name, inbox in self._inboxes.items()
        ]
        keeper = asyncio.create_task(self._keep_consuming(), name="rabbitmq-reconnect")
        try:
            await stop.wait()
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            channel = self._channel
            if channel is not None and not channel.is_closed:
                for tag in list(self._routes):
                    with contextlib.suppress(Exception):
                        await channel.basic_cancel(tag, timeout=self.CONNECT_TIMEOUT_S)
            self._routes = {}
            for task in dispatchers:
                task.cancel()
            await asyncio.gather(*dispatchers, return_exceptions=True)
            # Deliveries that reached us but were never started go straight back.
            for inbox in self._inboxes.values():
                while inbox.frames:
                    frame = inbox.frames.popleft()
                    with contextlib.suppress(Exception):
                        await self._requeue(frame)
            if processing:
                await asyncio.gather(*processing, return_exceptions=True)
            await self._acks.drain()

    def _arrived(self, frame: DeliveredMessage) -> None:
        """A delivery from the consuming channel's reader: into its channel's inbox."""
        delivery = _deliver(frame)
        inbox = self._routes.get(delivery.consumer_tag or "")
        if inbox is None or frame.channel is not self._channel:
            return  # a consumer being cancelled: unacked, it goes back with its channel
        self._acks.delivered(frame.channel, delivery.delivery_tag or 0)
        inbox.put(frame)

    async def _consume(self) -> None:
        """On a new channel: set the prefetch, declare each channel's queues, consume them."""
        assert self._connection is not None
        channel = await self._connection.channel(publisher_confirms=False)
        try:
            _deliver_from_the_reader(channel, self._arrived)
            await channel.basic_qos(prefetch_count=self.prefetch)
            routes: dict[str, _Inbox] = {}
            self._channel, self._routes = channel, routes
            for name, inbox in self._inboxes.items():
                await declare_queues(channel, name, options=self.options)
                # The tag is ours, so that the route exists before the first delivery.
                tag = f"dedupe.{name}.{uuid.uuid4().hex[:12]}"
                routes[tag] = inbox

                async def arrived(frame: DeliveredMessage) -> None:
                    self._arrived(frame)

                await channel.basic_consume(name, arrived, no_ack=False, consumer_tag=tag)
        except BaseException:
            with contextlib.suppress(Exception):
                await channel.close()
            raise

    async def _keep_consuming(self) -> None:
        """Whenever the connection or the consuming channel is lost, open them again (with
        backoff), declare the queues, set the prefetch and consume again.

        The lost channel's deliveries are dropped from the ack bookkeeping and from the inboxes:
        their tags mean nothing on a new channel, and the broker delivers them again (the claims
        make that a duplicate, or a take-over once the lease lapses).
        """
        while True:
            connection, channel = self._connection, self._channel
            assert connection is not None and channel is not None
            await self._closed_either(connection, channel)
            reason = channel_reason(channel) or channel_reason(connection)
            self._forget(channel)
            whole = connection.is_closed
            logger.warning(
                "lost the RabbitMQ %s (%s); %s",
                "connection" if whole else "consuming channel",
                reason or "closed",
                "reconnecting" if whole else "consuming on a new channel",
            )
            await self._restore()

    @staticmethod
    async def _closed_either(connection: AbstractConnection, channel: AbstractChannel) -> None:
        watchers = [connection.closing, channel.closing]
        try:
            await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for watcher in watchers:
                watcher.cancel()

    def _forget(self, channel: AbstractChannel) -> None:
        self._acks.drop(channel)
        for inbox in self._inboxes.values():
            if any(frame.channel is channel for frame in inbox.frames):
                kept = [frame for frame in inbox.frames if frame.channel is not channel]
                inbox.frames.clear()
                inbox.frames.extend(kept)

    async def _restore(self) -> None:
        """Connect (when the connection was lost) and consume again, retrying with backoff."""
        pause = 0.0
        attempt = 0
        lost = self._connection
        while True:
            if pause:
                await asyncio.sleep(pause)
            attempt += 1
            try:
                await self.connect()  # unless the connection is still open
                await self._consume()
            except Exception as exc:
                pause = min(max(pause * 2, self.RECONNECT_MIN_S), self.RECONNECT_MAX_S)
                logger.warning(
                    "could not consume from RabbitMQ again (attempt %d: %s); retrying in %.2f s",
                    attempt,
                    exc or type(exc).__name__,
                    pause,
                )
                continue
            whole = self._connection is not lost
            if whole:
                self.reconnects += 1
            logger.warning(
                "%s RabbitMQ after %d attempt%s: consuming %s again (prefetch %d)",
                "reconnected to" if whole else "a new consuming channel on",
                attempt,
                "" if attempt == 1 else "s",
                ", ".join(self._inboxes),
                self.prefetch,
                extra={"reconnects": self.reconnects},
            )
            return

    async def _dispatch(
        self,
        name: str,
        inbox: _Inbox,
        process: Process,
        processing: set[asyncio.Task[None]],
    ) -> None:
        """Hand whatever has arrived to the core as one batch (one claim statement).

        RabbitMQ sends a consumer as many deliveries as its acks free, so batches handed over
        the moment anything arrives stay as small as the acks that freed them (three
        deliveries a batch at a no-op backlog, each with its claim, completion and ack). Once
        `batches_in_flight` batches of the channel run, the next one gathers what arrives
        until one of them ends, no more can come, or GATHER_S pass (_gather); a lone delivery
        never waits.
        """
        frames = inbox.frames
        running: dict[asyncio.Task[None], int] = {}  # a running batch -> its deliveries
        depth = self.options.batches_in_flight

        def ended(task: asyncio.Task[None]) -> None:
            running.pop(task, None)
            inbox.ready.set()  # the gathering batch may go

        while True:
            if not frames:
                inbox.ready.clear()
                await inbox.ready.wait()
                continue
            if len(running) >= depth:
                await self._gather(inbox, running, depth)
                if not frames:  # dropped with a lost channel meanwhile
                    continue
            count = min(len(frames), self.batch_max)
            deliveries: list[Delivery] = [
                RabbitDelivery(self, name, frames.popleft()) for _ in range(count)
            ]
            task = asyncio.create_task(process(name, deliveries))
            processing.add(task)
            running[task] = count
            task.add_done_callback(processing.discard)
            task.add_done_callback(ended)
            task.add_done_callback(_log_failure)

    async def _gather(
        self, inbox: _Inbox, running: dict[asyncio.Task[None], int], depth: int
    ) -> None:
        """Wait, at most GATHER_S, while `depth` batches run and more deliveries can still
        come: the batch is not full, and the prefetch window is not all taken by it and by the
        running batches (their deliveries are unacked until they end)."""

        def waiting() -> bool:
            gathered = len(inbox.frames)
            return (
                len(running) >= depth
                and gathered < self.batch_max
                and gathered + sum(running.values()) < self.prefetch
            )

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.GATHER_S):
                while waiting():
                    inbox.ready.clear()
                    await inbox.ready.wait()  # a delivery arrived or a batch ended

    async def settle(self, delivery: RabbitDelivery, settlement: Settlement) -> bool:
        """Carry out the settlement; False when a copy could not be routed and the delivery
        was requeued instead (a dead letter then is not sent: its next delivery sends it)."""
        frame = delivery.frame
        properties = frame.header.properties
        # A delivery of a lost channel comes again: no reply or copy for it now, its
        # redelivery sends them.
        self._usable(frame)
        if settlement.action is Action.ACK:
            if properties.reply_to and (reply := reply_of(settlement)) is not None:
                await self.copies.reply(properties, *reply)
            await self._ack(frame)
        elif settlement.action is Action.DEAD_LETTER:
            headers: dict[str, Any] = dict(properties.headers or {})
            headers.update(dead_letter_headers(settlement))
            dead_letter = copy_properties(properties, headers=headers)
            dlq = dlq_name(delivery.channel)
            if not await self.copies.copy(frame.body, dead_letter, delivery.channel, dlq):
                return await self._give_back(frame, dlq)
            if properties.reply_to and (reply := reply_of(settlement)) is not None:
                await self.copies.reply(properties, *reply)
            await self._ack(frame)
            logger.warning(
                "dead-lettered a message from %s to %s: %s (%s)",
                delivery.channel,
                dlq,
                settlement.reason,
                settlement.detail,
                extra={
                    "channel": delivery.channel,
                    "scope": settlement.scope,
                    "key": settlement.key,
                    "message_id": properties.message_id,
                    "reason": str(settlement.reason),
                    "outcome": str(settlement.action),
                },
            )
        elif settlement.action is Action.DEFER or settlement.delay_s > 0:
            headers = dict(properties.headers or {})
            if settlement.action is Action.DEFER:
                headers[DEFERRALS_HEADER] = delivery.message.attempt
            delay = max(settlement.delay_s, 0.05)
            later = copy_properties(properties, headers=headers, expiration_s=delay)
            queue = delay_name(delivery.channel, delay)
            if not await self.copies.copy(frame.body, later, delivery.channel, queue):
                return await self._give_back(frame, queue)
            await self._ack(frame)
        else:
            await self._requeue(frame)
        return True

    async def _give_back(self, frame: DeliveredMessage, queue: str) -> bool:
        """Requeue a delivery whose copy RabbitMQ would not route, rather than ack it."""
        logger.warning(
            "no way to route a copy to %s; the message goes back to its queue",
            queue,
            extra={"message_id": frame.header.properties.message_id},
        )
        await asyncio.sleep(self.UNROUTABLE_PAUSE_S)
        await self._requeue(frame)
        return False

    def _usable(self, frame: DeliveredMessage) -> AbstractChannel:
        channel = frame.channel
        if channel.is_closed:
            self._acks.drop(channel)
            raise ChannelInvalidStateError("the channel is closed")
        return channel

    async def _ack(self, frame: DeliveredMessage) -> None:
        """Acknowledge, in a run with the deliveries settled beside it (one frame for many)."""
        channel = self._usable(frame)
        tag = _tag(frame)
        if not self._acks.ack(channel, tag):
            await channel.basic_ack(tag)

    async def _requeue(self, frame: DeliveredMessage) -> None:
        """Give the delivery back to its queue (a single nack, never a multiple one)."""
        channel = self._usable(frame)
        tag = _tag(frame)
        if not self._acks.requeue(channel, tag):
            await channel.basic_nack(tag, requeue=True)


def channel_reason(closable: AbstractChannel | AbstractConnection) -> str | None:
    """Why a channel or connection closed, as far as aiormq tells."""
    if not closable.is_closed:
        return None
    closing = closable.closing  # the closed future itself, once closed
    if closing.cancelled():
        return None
    exc = closing.exception()
    return None if exc is None else (str(exc) or type(exc).__name__)


__all__ = ["RabbitDelivery", "RabbitMQTransport"]
