"""RabbitMQ transport on aio-pika: robust connection, manual acks after the outcome is recorded.

Topology per channel `C` (all durable):
  C          the work queue; rejected messages dead-letter to C.dlq through the default exchange
  C.dlq      dead letters, with the reason in `x-dedupe-reason` / `x-dedupe-detail` headers
  C.delay    no consumers: deferred messages wait out their per-message TTL, then return to C

Copies to C.dlq and C.delay are `mandatory`: one RabbitMQ cannot route (the queue was deleted
or expired) comes back instead of vanishing, and the original is never acked into nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

try:
    import aio_pika
    from aio_pika.abc import (
        AbstractChannel,
        AbstractIncomingMessage,
        AbstractQueue,
        AbstractRobustConnection,
    )
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the RabbitMQ transport needs aio-pika: pip install 'dedupe-worker[rabbitmq]'"
    ) from exc

from dedupe.errors import DedupeError
from dedupe.message import Headers, Message
from dedupe.replay import Release, ReplayPolicy, describe
from dedupe.store import redact
from dedupe.transport import (
    Action,
    Delivery,
    Process,
    Settlement,
    Transport,
    dead_letter_headers,
    dlq_name,
)

logger = logging.getLogger(__name__)

DEFERRALS_HEADER = "x-dedupe-deferrals"
# The transport adds the deferral count besides the dead-letter headers; a replay strips both.
REPLAY = ReplayPolicy(own_headers=(DEFERRALS_HEADER,))


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


class _Acks:
    """Acknowledges settled deliveries with one multiple-ack per run of consecutive tags.

    Settling marks a delivery tag done; once per loop iteration the longest done prefix of each
    AMQP channel's tags goes out as one `basic.ack(multiple=True)`. A done tag stuck behind one
    still running is acked on its own after `LATE_S`, so a slow handler never holds back the
    others' prefetch slots for longer. A lost ack frame means a redelivery, which the claims
    turn into a duplicate: the same as an ack lost on the wire. A closed channel's tags are
    dropped whole: its unacked deliveries go back to their queues on the broker's side and no
    ack for them can be sent any more (after a reconnect, the old channel never comes back).
    """

    LATE_S = 0.05

    def __init__(self) -> None:
        self._tags: dict[Any, dict[int, bool]] = {}  # AMQP channel -> {tag: done}, in order
        self._due = False
        self._late: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def delivered(self, incoming: AbstractIncomingMessage) -> None:
        self._drop_closed()
        if incoming.delivery_tag is not None:
            self._tags.setdefault(incoming.channel, {})[incoming.delivery_tag] = False

    def forget(self, incoming: AbstractIncomingMessage) -> None:
        """The delivery is settled some other way (nack) or cannot be (its channel closed)."""
        self._tags.get(incoming.channel, {}).pop(incoming.delivery_tag or 0, None)
        self._drop_closed()

    def _drop_closed(self) -> None:
        for channel in [channel for channel in self._tags if channel.is_closed]:
            del self._tags[channel]

    def ack(self, incoming: AbstractIncomingMessage) -> bool:
        """Mark the delivery acked; False when it is not tracked (ack it directly)."""
        tags = self._tags.get(incoming.channel)
        if tags is None or incoming.delivery_tag not in tags:
            return False
        tags[incoming.delivery_tag] = True
        self._wake()
        return True

    def _wake(self) -> None:
        self._due = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush(), name="rabbitmq-acks")

    async def _flush(self, *, late: bool = False) -> None:
        while self._due:
            self._due = False
            for channel, tags in list(self._tags.items()):
                if channel.is_closed:
                    self._tags.pop(channel, None)
                    continue
                last = None
                while tags:
                    tag = next(iter(tags))
                    if not tags[tag]:
                        break
                    del tags[tag]
                    last = tag
                single = [tag for tag, done in tags.items() if done] if late else []
                for tag in single:
                    del tags[tag]
                try:
                    if last is not None:
                        await channel.basic_ack(delivery_tag=last, multiple=True)
                    for tag in single:
                        await channel.basic_ack(delivery_tag=tag)
                except Exception as exc:
                    # The channel is gone: the broker delivers these again.
                    logger.warning("could not acknowledge deliveries (%s); they come again", exc)
                if tags and any(tags.values()) and self._late is None:
                    self._late = asyncio.get_running_loop().call_later(self.LATE_S, self._lately)
            late = False

    def _lately(self) -> None:
        self._late = None
        self._due = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush(late=True), name="rabbitmq-acks")
        else:
            self._late = asyncio.get_running_loop().call_later(self.LATE_S, self._lately)

    async def drain(self) -> None:
        if self._late is not None:
            self._late.cancel()
            self._late = None
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._due = True
        await self._flush(late=True)


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
        self._publish_channel: AbstractChannel | None = None
        self._reopening = asyncio.Lock()
        self._acks = _Acks()
        self._copying: dict[str, asyncio.Event] = {}  # message ids with a copy in flight

    async def connect(self) -> None:
        if self._connection is None:
            self._connection = await aio_pika.connect_robust(
                self.url, timeout=10, client_properties={"connection_name": self.connection_name}
            )
            self._channel = await self._connection.channel()
            await self._channel.set_qos(prefetch_count=self.prefetch)
            # Copies go out on their own confirming channel so that a slow confirm never
            # holds up deliveries on the consuming one.
            self._publish_channel = await self._connection.channel(
                publisher_confirms=True, on_return_raises=True
            )

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
                await self._reply(incoming, settlement.result)
            await self._ack(incoming)
        elif settlement.action is Action.DEAD_LETTER:
            headers: dict[str, Any] = dict(incoming.headers or {})
            headers.update(dead_letter_headers(settlement))
            dead_letter = copy_of(incoming, headers=headers)
            if not await self._copy(dead_letter, delivery.channel, dlq_name(delivery.channel)):
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
            if not await self._copy(later, delivery.channel, delay_name(delivery.channel)):
                return await self._give_back(incoming, delay_name(delivery.channel))
            await self._ack(incoming)
        else:
            self._acks.forget(incoming)
            await incoming.nack(requeue=True)
        return True

    async def _copy(self, message: aio_pika.Message, channel: str, queue: str) -> bool:
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
        if self._connection is None:
            raise aio_pika.exceptions.ChannelInvalidStateError("the transport is closed")
        channel = await self._connection.channel(publisher_confirms=False)
        try:
            await declare_channel(channel, name)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

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

    async def _publish(self, message: aio_pika.Message, routing_key: str) -> None:
        channel = self._publish_channel
        if channel is None or channel.is_closed:
            channel = await self._reopen_publish_channel()
        # mandatory: a message RabbitMQ cannot route raises (on_return_raises) instead of
        # being confirmed and dropped.
        await channel.default_exchange.publish(message, routing_key=routing_key, mandatory=True)

    async def _reopen_publish_channel(self) -> AbstractChannel:
        """A new confirming channel for copies (dead letters, delays, replies).

        aio-pika restores a robust channel after a reconnect, except when the restore itself
        fails while the broker is still going down; then the channel stays closed for good
        and, without this, every later dead letter and deferral would fail (found by the
        chaos suite: poison messages redelivered forever after a RabbitMQ restart).
        """
        async with self._reopening:
            channel = self._publish_channel
            if channel is None or channel.is_closed:
                if self._connection is None:
                    raise aio_pika.exceptions.ChannelInvalidStateError("the transport is closed")
                logger.info("reopening the channel for dead letters and delays")
                channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
                self._publish_channel = channel
            return channel

    async def _reply(self, incoming: AbstractIncomingMessage, result: str) -> None:
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


async def peek_dead_letters(url: str, channel: str, *, limit: int) -> list[dict[str, Any]]:
    """Read up to `limit` dead letters without removing them (they return on close)."""
    found: list[dict[str, Any]] = []
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        amqp = await connection.channel()
        queue = await declare_channel(amqp, channel)
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
    published, is dedupe.replay's policy; a dead letter it skips stays in <channel>.dlq.
    """
    moved: list[dict[str, Any]] = []
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        amqp = await connection.channel(publisher_confirms=True)
        await declare_channel(amqp, channel)
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
            moved.append(step.row)

            async def republish(
                headers: dict[str, Any], incoming: AbstractIncomingMessage = incoming
            ) -> None:
                await amqp.default_exchange.publish(copy_of(incoming, headers=headers), channel)

            await step.carry_out(release=release, republish=republish)
            await incoming.ack()
    return moved


async def publish(
    url: str, channel: str, messages: Sequence[tuple[bytes, dict[str, Any], str | None]]
) -> int:
    """Publish (body, headers, message_id) triples with confirms; declares the channel first."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        amqp = await connection.channel(publisher_confirms=True)
        await declare_channel(amqp, channel)
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
            )
            for body, headers, message_id in messages
        ]
        for start in range(0, len(pending), 500):
            await asyncio.gather(*pending[start : start + 500])
    return len(messages)


async def delete_channels(url: str, channels: Iterable[str]) -> int:
    """Delete each channel's queues (C, C.delay, C.dlq) with whatever they hold.

    For tests, benchmarks and operators tidying up channels that are gone; missing queues are
    no error. Returns how many queue names were deleted.
    """
    names = [n for c in channels for n in (c, delay_name(c), dlq_name(c))]
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        amqp = await connection.channel()
        for name in names:
            await amqp.queue_delete(name)  # RabbitMQ answers delete-ok for a missing queue too
    return len(names)


class RabbitMQPublisher:
    """Publishes with publisher confirms on one robust connection (the webhook receiver's).

    Each channel's queues are declared before its first publish; messages are persistent and
    `mandatory`, so a message RabbitMQ cannot route is an error, not a silent drop.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._declared: set[str] = set()
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        """Open the connection and the confirming channel unless they are open already."""
        if self._channel is not None and not self._channel.is_closed:
            return
        async with self._lock:
            if self._channel is not None and not self._channel.is_closed:
                return
            try:
                if self._connection is None or self._connection.is_closed:
                    self._connection = await aio_pika.connect_robust(
                        self.url, timeout=self.timeout_s
                    )
                self._channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
            except Exception as exc:
                await self._discard()
                raise DedupeError(
                    f"cannot connect to RabbitMQ at {redact(self.url)} ({exc.__class__.__name__})"
                ) from exc
            self._declared.clear()

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        """Return once RabbitMQ has confirmed the message; raise DedupeError otherwise."""
        await self.connect()
        amqp = self._channel
        assert amqp is not None
        try:
            if channel not in self._declared:
                await declare_channel(amqp, channel)
                self._declared.add(channel)
            message = aio_pika.Message(
                body,
                headers=dict(headers),
                message_id=message_id,
                content_type=Headers(headers).get("content-type"),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                app_id="dedupe-worker",
            )
            await amqp.default_exchange.publish(
                message, routing_key=channel, mandatory=True, timeout=self.timeout_s
            )
        except Exception as exc:
            # Unroutable (the queue was deleted) or not confirmed: declare again next time.
            self._declared.discard(channel)
            raise DedupeError(
                f"RabbitMQ did not confirm a message to {channel} ({exc.__class__.__name__})"
            ) from exc

    async def ready(self) -> bool:
        """Whether a publish could go out now (connects if needed)."""
        try:
            await self.connect()
        except DedupeError:
            return False
        return self._channel is not None and not self._channel.is_closed

    async def close(self) -> None:
        """Close the connection; safe to call twice."""
        async with self._lock:
            await self._discard()

    async def _discard(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._declared.clear()
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()
