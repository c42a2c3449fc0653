"""The confirming RabbitMQ publisher of the webhook receiver and the outbox relay."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

try:
    import aio_pika
    from aio_pika.abc import (
        AbstractChannel,
        AbstractRobustConnection,
    )
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the RabbitMQ transport needs aio-pika: pip install 'dedupe-worker[rabbitmq]'"
    ) from exc

from dedupe.errors import DedupeError
from dedupe.message import Headers
from dedupe.store import redact

from .rabbitmq_topology import declare_channel


class RabbitMQPublisher:
    """Publishes with publisher confirms on one robust connection (the webhook receiver's and
    the outbox relay's).

    Each channel's queues are declared before its first publish; messages are persistent and
    `mandatory`, so a message RabbitMQ cannot route is an error, not a silent drop.

    The publishes are spread over `channels` confirming channels, each to the one with the
    fewest in flight: aiormq sends one publish at a time per channel and holds the channel
    until the frame is written, so in a busy event loop (a worker's handlers beside its relay)
    one channel carries a publish every few loop turns; a few hundred in flight then wait for
    it, past their timeout. Every publish is confirmed on its own; callers that need an order
    (the relay, per producer) wait for one confirm before the next publish.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, channels: int = 8) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._connection: AbstractRobustConnection | None = None
        self._channels: list[AbstractChannel] = []
        self._in_flight = [0] * max(1, channels)
        self._declared: set[str] = set()
        self._lock = asyncio.Lock()

    def _open(self) -> bool:
        return len(self._channels) == len(self._in_flight) and not any(
            channel.is_closed for channel in self._channels
        )

    async def connect(self) -> None:
        """Open the connection and the confirming channels unless they are open already."""
        if self._open():
            return
        async with self._lock:
            if self._open():
                return
            try:
                if self._connection is None or self._connection.is_closed:
                    self._connection = await aio_pika.connect_robust(
                        self.url, timeout=self.timeout_s
                    )
                    self._channels = []
                self._channels = [channel for channel in self._channels if not channel.is_closed]
                while len(self._channels) < len(self._in_flight):
                    self._channels.append(
                        await self._connection.channel(
                            publisher_confirms=True, on_return_raises=True
                        )
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
        slot = min(range(len(self._in_flight)), key=self._in_flight.__getitem__)
        amqp = self._channels[slot]
        self._in_flight[slot] += 1
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
        finally:
            self._in_flight[slot] -= 1

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
        connection, self._connection, self._channels = self._connection, None, []
        self._declared.clear()
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()
