"""The confirming RabbitMQ publisher of the webhook receiver and the outbox relay."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import cast

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractQueue,
)

from dedupe.claims.database import redact
from dedupe.errors import BrokerUnavailable, DedupeError
from dedupe.message import Headers
from dedupe_rabbitmq.connection import connect as connect_nodes
from dedupe_rabbitmq.options import BrokerUrl
from dedupe_rabbitmq.topology import declare_channel


class RabbitMQPublisher:
    """Publishes with publisher confirms on one connection (the webhook receiver's and the
    outbox relay's), opened again at the next publish once it or a channel is closed. Not a
    robust one: aio-pika would reopen a channel the broker closed beside its replacement.

    Each channel's queues are declared before its first publish (once, however many publishes
    wait for it); messages are persistent and `mandatory`, so a message RabbitMQ cannot route
    is an error, not a silent drop, and its queues are declared again at the next publish.

    The publishes are spread over `channels` confirming channels, each to the one with the
    fewest in flight: aiormq sends one publish at a time per channel and holds the channel
    until the frame is written, so in a busy event loop (a worker's handlers beside its relay)
    one channel carries a publish every few loop turns; a few hundred in flight then wait for
    it, past their timeout. Every publish is confirmed on its own; callers that need an order
    (the relay, per producer) wait for one confirm before the next publish. `timeout_s` bounds
    a (re)connect, and then the publish: its declare, its turn on the channel and its confirm.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, channels: int = 8) -> None:
        self.url = url
        self.options = BrokerUrl.parse(url).options
        self.timeout_s = timeout_s
        self._connection: AbstractConnection | None = None
        self._channels: list[AbstractChannel | None] = [None] * max(1, channels)
        self._in_flight = [0] * len(self._channels)
        self._declared: set[str] = set()
        self._declaring: dict[str, asyncio.Task[AbstractQueue]] = {}
        self._lock = asyncio.Lock()
        # The last failed connect (when, why): publishes that waited for it fail with it
        # rather than each try again in turn (hundreds in flight, one timeout each).
        self._failure: tuple[float, BrokerUnavailable] | None = None

    def _open(self) -> bool:
        return all(channel is not None and not channel.is_closed for channel in self._channels)

    async def connect(self) -> None:
        """Open the connection and the confirming channels unless they are open already."""
        if self._open():
            return
        asked = time.monotonic()
        async with self._lock:
            if self._open():
                return
            if self._failure is not None and self._failure[0] >= asked:
                failed = self._failure[1]
                raise BrokerUnavailable(str(failed)) from failed.__cause__
            try:
                async with asyncio.timeout(self.timeout_s):
                    connection = self._connection
                    if connection is None or connection.is_closed:
                        await self._discard()
                        # The URL's nodes in order: after a lost node, the next that answers.
                        connection = cast(
                            AbstractConnection,
                            await connect_nodes(
                                self.url, aio_pika.connect, timeout_s=self.timeout_s
                            ),
                        )
                        self._connection = connection
                    for slot, old in enumerate(self._channels):
                        if old is None or old.is_closed:  # a channel the broker closed
                            self._channels[slot] = await connection.channel(
                                publisher_confirms=True, on_return_raises=True
                            )
            except Exception as exc:
                await self._discard()
                error = BrokerUnavailable(
                    f"cannot connect to RabbitMQ at {redact(self.url)} ({exc.__class__.__name__})"
                )
                self._failure = (time.monotonic(), error)
                raise error from exc
            self._failure = None

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        """Return once RabbitMQ has confirmed the message; raise DedupeError otherwise."""
        slot = min(range(len(self._in_flight)), key=self._in_flight.__getitem__)
        amqp = self._channels[slot]
        if amqp is None or amqp.is_closed:
            # Only the channel this publish takes is checked (all of them were, on every
            # publish: ~7 % of the webhook receiver's CPU); connect() replaces every closed one.
            await self.connect()
            amqp = self._channels[slot]
            assert amqp is not None
        self._in_flight[slot] += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._declare(amqp, channel)
                message = aio_pika.Message(
                    body,
                    headers=dict(headers),
                    message_id=message_id,
                    content_type=Headers(headers).get("content-type"),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    app_id="dedupe-worker",
                )
                await amqp.default_exchange.publish(message, routing_key=channel, mandatory=True)
        except Exception as exc:
            if isinstance(exc, aio_pika.exceptions.PublishError):
                self._declared.discard(channel)  # unroutable: its queue was deleted
            raise DedupeError(
                f"RabbitMQ did not confirm a message to {channel} ({exc.__class__.__name__})"
            ) from exc
        finally:
            self._in_flight[slot] -= 1

    async def _declare(self, amqp: AbstractChannel, channel: str) -> None:
        """Declare a channel's queues once: concurrent publishes to it wait for one declare."""
        if channel in self._declared:
            return
        pending = self._declaring.get(channel)
        if pending is None:
            pending = asyncio.create_task(self._declared_within(amqp, channel))
            self._declaring[channel] = pending

            def done(future: asyncio.Task[AbstractQueue]) -> None:
                if self._declaring.get(channel) is future:
                    del self._declaring[channel]
                if not future.cancelled() and future.exception() is None:
                    self._declared.add(channel)

            pending.add_done_callback(done)
        # Shielded: one publish's timeout does not cancel the declare the others wait for.
        await asyncio.shield(pending)

    async def _declared_within(self, amqp: AbstractChannel, channel: str) -> AbstractQueue:
        async with asyncio.timeout(self.timeout_s):
            return await declare_channel(amqp, channel, options=self.options)

    async def ready(self) -> bool:
        """Whether a publish could go out now (connects if needed)."""
        try:
            await self.connect()
        except DedupeError:
            return False
        return self._open()

    async def close(self) -> None:
        """Close the connection; safe to call twice."""
        async with self._lock:
            await self._discard()

    async def _discard(self) -> None:
        connection, self._connection = self._connection, None
        self._channels = [None] * len(self._channels)
        self._declared.clear()
        declaring, self._declaring = self._declaring, {}
        for task in declaring.values():
            task.cancel()
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()
