"""The in-memory broker for tests: channels as queues, competing consumers, redelivery of what a
consumer deferred or left unsettled, lost acks, dead letters with their reasons.

Only the broker is replaced: the claims stay in PostgreSQL, where the guarantees live. Time is
compressed: a redelivery the pipeline asks for after `d` seconds comes after
`min(d, max_delay_s)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dedupe.errors import BrokerUnavailable
from dedupe.message import Message
from dedupe.testing.deliveries import (
    Fate,
    MemoryDelivery,
    Sent,
    Settled,
    encode_body,
    make_message,
)
from dedupe.transport import Action, Process, Settlement, Transport

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Copy:
    """One published copy of a message, followed until the broker is done with it."""

    sent: Sent
    lose_ack: bool


class MemoryBroker:
    """Channels as queues shared by competing consumers (MemoryTransport), like RabbitMQ.

    Args:
        max_delay_s: Longest wait before a deferred or requeued message comes back (time
            compressed for tests); None waits as long as the pipeline asks.
    """

    def __init__(self, *, max_delay_s: float | None = 0.1) -> None:
        self.max_delay_s = max_delay_s
        self.log: list[Settled] = []
        self._queues: dict[str, list[tuple[_Copy, Message]]] = {}
        self._consumers: list[MemoryTransport] = []
        self._outstanding: dict[_Copy, Message] = {}
        self._timers: set[asyncio.TimerHandle] = set()
        self._ids = itertools.count(1)
        self._turn = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        # Every channel a consumer ever subscribed to: a relayed publish to one of them is
        # delivered (and awaited by idle()); to any other, only kept in `published`.
        self.consumed: set[str] = set()
        self.published: list[Message] = []

    @property
    def acked(self) -> list[Settled]:
        return [s for s in self.log if s.fate == "acked"]

    @property
    def dead_letters(self) -> list[Settled]:
        return [s for s in self.log if s.fate == "dead_lettered"]

    @property
    def outstanding(self) -> list[Message]:
        """The latest delivery of every copy not acked or dead-lettered yet."""
        return list(self._outstanding.values())

    def publish(
        self,
        channel: str,
        body: bytes | str | Any,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        copies: int = 1,
        delay_s: float = 0.0,
        lose_ack: bool = False,
        after_s: float = 0.0,
    ) -> Sent:
        """Publish a message (bytes, text, a pydantic model or a JSON value).

        Args:
            copies: How many times the producer sends it; the copies go out at the same moment
                (a concurrent duplicate) unless `delay_s` spaces them.
            delay_s: Each copy after the first comes this much later than the one before.
            after_s: The first copy goes out this much later (it counts as outstanding now).
            lose_ack: The first ack of the message never reaches the broker, which delivers
                it again (a connection that dropped between the ack and the broker).
        """
        if copies < 1:
            raise ValueError("copies must be at least 1")
        message = make_message(
            channel,
            encode_body(body),
            message_id=message_id or f"m-{next(self._ids)}",
            headers=headers,
            # As RabbitMQ marks it: a copy's first delivery is not a redelivery (the
            # one-transaction path takes first deliveries only: dedupe.pipeline.one_transaction).
            meta={"redelivered": False},
        )
        sent = Sent(message)
        for number in range(copies):
            copy = _Copy(sent, lose_ack=lose_ack and number == 0)
            self._outstanding[copy] = message
            self._idle.clear()
            self._later(after_s + number * delay_s, copy, message)
        return sent

    async def idle(self, timeout_s: float = 30.0) -> None:
        """Wait until every copy published is acked or dead-lettered."""
        async with asyncio.timeout(timeout_s):
            await self._idle.wait()

    def transport(self, name: str = "memory") -> MemoryTransport:
        """A new consumer of this broker's channels, to serve a worker."""
        return MemoryTransport(self, name=name)

    def publisher(self) -> MemoryPublisher:
        """A publisher on this broker, for the outbox relay (ctx.publish)."""
        return MemoryPublisher(self)

    def published_to(self, channel: str) -> list[Message]:
        """The messages relayed to `channel` from the outbox (ctx.publish), in order; a row the
        relay sent twice (it died before marking it sent) is there twice, with the same id."""
        return [message for message in self.published if message.channel == channel]

    def close(self) -> None:
        """Cancel the redeliveries still waiting for their time."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    # -- consumers ---------------------------------------------------------------------

    def _subscribe(self, consumer: MemoryTransport) -> None:
        if consumer not in self._consumers:
            self._consumers.append(consumer)
        self.consumed.update(consumer.channels)
        for channel in consumer.channels:
            self._dispatch(channel)

    def _unsubscribe(self, consumer: MemoryTransport) -> None:
        with contextlib.suppress(ValueError):
            self._consumers.remove(consumer)

    def _requeue(self, copy: _Copy, message: Message) -> None:
        """Take a delivery back from a consumer that is gone: delivered again at once."""
        self._again(copy, message, 0.0)

    def _later(self, delay_s: float, copy: _Copy, message: Message) -> None:
        if delay_s <= 0:
            self._enqueue(copy, message)
            return
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def fire() -> None:
            assert timer is not None
            self._timers.discard(timer)
            self._enqueue(copy, message)

        timer = loop.call_later(delay_s, fire)
        self._timers.add(timer)

    def _enqueue(self, copy: _Copy, message: Message) -> None:
        self._queues.setdefault(message.channel, []).append((copy, message))
        self._dispatch(message.channel)

    def _dispatch(self, channel: str) -> None:
        queue = self._queues.get(channel)
        while queue:
            consumers = [c for c in self._consumers if channel in c.channels]
            if not consumers:
                return  # it waits for a consumer, as on a durable queue
            consumer = consumers[next(self._turn) % len(consumers)]
            copy, message = queue.pop(0)
            copy.sent.deliveries += 1
            delivery = MemoryDelivery(message)
            delivery.on_settle = lambda d, s, c=consumer, cp=copy: self._settled(c, cp, d, s)
            consumer._deliver(delivery, copy)

    def _settled(
        self,
        consumer: MemoryTransport,
        copy: _Copy,
        delivery: MemoryDelivery,
        settlement: Settlement,
    ) -> bool:
        message = delivery.message
        if consumer._unsettled.pop(delivery, None) is None or not consumer.connected:
            self._note(copy, message, settlement, consumer, "dropped")
            return False
        if settlement.action is Action.ACK:
            if copy.lose_ack:
                copy.lose_ack = False
                self._note(copy, message, settlement, consumer, "ack_lost")
                self._again(copy, message, 0.0)
                return True
            self._note(copy, message, settlement, consumer, "acked")
            self._done(copy)
        elif settlement.action is Action.DEAD_LETTER:
            self._note(copy, message, settlement, consumer, "dead_lettered")
            self._done(copy)
        else:
            self._note(copy, message, settlement, consumer, "redelivered")
            self._again(copy, message, settlement.delay_s)
        return True

    def _done(self, copy: _Copy) -> None:
        self._outstanding.pop(copy, None)
        if not self._outstanding:
            self._idle.set()

    def _again(self, copy: _Copy, message: Message, delay_s: float) -> None:
        again = Message(
            channel=message.channel,
            body=message.body,
            headers=message.headers,
            message_id=message.message_id,
            attempt=message.attempt + 1,
            content_type=message.content_type,
            meta={**message.meta, "redelivered": True},
        )
        self._outstanding[copy] = again
        limit = self.max_delay_s
        self._later(delay_s if limit is None else min(delay_s, limit), copy, again)

    def _note(
        self,
        copy: _Copy,
        message: Message,
        settlement: Settlement,
        consumer: MemoryTransport,
        fate: Fate,
    ) -> None:
        settled = Settled(message, settlement, consumer.name, fate)
        self.log.append(settled)
        copy.sent.log.append(settled)


class MemoryPublisher:
    """The outbox relay's publisher on a MemoryBroker (what a worker's ctx.publish goes
    through): every message is kept in `broker.published`; one to a channel a consumer of the
    broker reads is delivered to it, as a real broker's queue would (a two-stage chain runs);
    one to any other channel goes nowhere else (a service outside the test)."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.connected = True  # False: its process died (dedupe.testing's workers)

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        if not self.connected:
            raise BrokerUnavailable("the memory publisher's worker is gone")
        headers = dict(headers)
        content_type = headers.pop("content-type", None)
        message = make_message(
            channel, body, message_id=message_id, headers=headers, meta={"redelivered": False}
        )
        if content_type is not None:
            message = dataclasses.replace(message, content_type=content_type)
        self.broker.published.append(message)
        if channel in self.broker.consumed:
            self.broker.publish(channel, body, message_id=message_id, headers=headers)

    async def close(self) -> None:
        """Nothing to release."""


class MemoryTransport(Transport):
    """A consumer of a MemoryBroker's channels: each delivery goes to the pipeline on its own.

    `Worker(app, transport=MemoryTransport(), database_url=...)` runs an app on it.
    """

    def __init__(self, broker: MemoryBroker | None = None, *, name: str = "memory") -> None:
        self.broker = broker if broker is not None else MemoryBroker()
        self.name = name
        self.channels: frozenset[str] = frozenset()
        self.connected = True
        self._process: Process | None = None
        self._context = contextvars.copy_context()
        self._unsettled: dict[MemoryDelivery, tuple[_Copy, Message]] = {}
        self._running: set[asyncio.Task[None]] = set()

    def publish(
        self,
        channel: str,
        body: bytes | str | Any,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> Sent:
        """Publish on this consumer's broker."""
        return self.broker.publish(channel, body, message_id=message_id, headers=headers)

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until every message on the broker is acked or dead-lettered."""
        await self.broker.idle(timeout_s)

    @property
    def in_flight(self) -> int:
        """Deliveries handed to the pipeline whose processing has not returned."""
        return sum(not task.done() for task in self._running)

    async def serve(self, channels: Sequence[str], process: Process, stop: asyncio.Event) -> None:
        self._process = process
        # Deliveries run in the serving task's context, as on a real broker's consumer task,
        # whoever's publish dispatched them.
        self._context = contextvars.copy_context()
        self.channels = frozenset(channels)
        self.broker._subscribe(self)
        try:
            await stop.wait()
        finally:
            # No new deliveries; those under way are still settled (the connection is open).
            self.broker._unsubscribe(self)

    def disconnect(self, *, cancel: bool = False) -> None:
        """Lose the connection: the broker delivers again what this consumer did not settle
        and ignores what it settles from now on; `cancel` stops its runs too (a dead process)."""
        self.connected = False
        self.broker._unsubscribe(self)
        unsettled, self._unsettled = self._unsettled, {}
        for copy, message in unsettled.values():
            self.broker._requeue(copy, message)
        if cancel:
            for task in self._running:
                task.cancel()

    async def close(self) -> None:
        self.disconnect()
        running = [task for task in self._running if not task.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _deliver(self, delivery: MemoryDelivery, copy: _Copy) -> None:
        assert self._process is not None
        self._unsettled[delivery] = (copy, delivery.message)
        task = asyncio.create_task(
            self._run(self._process, delivery), name="dedupe-memory", context=self._context.copy()
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, process: Process, delivery: MemoryDelivery) -> None:
        try:
            await process(delivery.message.channel, [delivery])
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception:
            logger.exception("the pipeline failed on a delivery; it stays unsettled")
        except BaseException:
            return  # cancelled, or a simulated process death (dedupe.testing's crash points)
        if delivery in self._unsettled and self.connected:
            logger.error("the pipeline returned without settling %s", delivery.message.message_id)


__all__ = ["MemoryBroker", "MemoryPublisher", "MemoryTransport"]
