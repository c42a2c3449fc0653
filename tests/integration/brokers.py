"""One face for both brokers, so that a handler-level test body runs on RabbitMQ and on Kafka."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import aio_pika

import dedupe_kafka as kafka
import dedupe_rabbitmq as rabbitmq
from dedupe.transport import Transport

Messages = Sequence[tuple[bytes, Mapping[str, Any], str | None]]
Release = Callable[[str, str], Awaitable[object]]


class Broker(Protocol):
    name: str

    async def publish(
        self, channel: str, messages: Messages, *, partition: int | None = None
    ) -> None:
        """Publish (body, headers, message_id) triples; `partition` pins them on Kafka."""

    def transport(self, **options: Any) -> Transport:
        """A new consumer (one worker); on Kafka all of a test's workers share one group."""

    async def dead_letters(self, channel: str) -> list[dict[str, Any]]:
        """The channel's dead letters (message_id, reason, detail, scope, key), left in place."""

    async def replay(self, channel: str, release: Release) -> list[dict[str, Any]]:
        """Move the channel's dead letters back (dlq replay), releasing each failed claim."""

    async def backlog(self, channel: str) -> int:
        """Messages not yet consumed for good (RabbitMQ: queued or delayed; Kafka: the group's
        lag on the channel and its retry topics)."""

    async def ready(self, channel: str, *transports: Transport) -> None:
        """Wait until the workers consume (Kafka: the group has spread the partitions)."""


class RabbitBroker:
    name = "rabbitmq"

    def __init__(self, url: str) -> None:
        self.url = url

    async def publish(
        self, channel: str, messages: Messages, *, partition: int | None = None
    ) -> None:
        await rabbitmq.publish(self.url, channel, [(b, dict(h), m) for b, h, m in messages])

    def transport(self, **options: Any) -> Transport:
        return rabbitmq.RabbitMQTransport(self.url, **options)

    async def dead_letters(self, channel: str) -> list[dict[str, Any]]:
        return await rabbitmq.peek_dead_letters(self.url, channel, limit=100)

    async def replay(self, channel: str, release: Release) -> list[dict[str, Any]]:
        return await rabbitmq.replay_dead_letters(self.url, channel, limit=100, release=release)

    async def backlog(self, channel: str) -> int:
        connection = await aio_pika.connect(self.url)
        async with connection:
            amqp = await connection.channel()
            total = 0
            for name in (channel, *rabbitmq.delay_queues(channel)):
                queue = await amqp.declare_queue(name, passive=True)
                total += int(queue.declaration_result.message_count or 0)
            return total

    async def ready(self, channel: str, *transports: Transport) -> None:
        await asyncio.sleep(0.2)  # consumers attach as soon as serve() runs


class KafkaBroker:
    name = "kafka"

    def __init__(self, url: str, **options: Any) -> None:
        self.group_id = f"t-{uuid.uuid4().hex[:10]}"
        self.url = kafka.with_options(url, group_id=self.group_id, **options)

    async def publish(
        self, channel: str, messages: Messages, *, partition: int | None = None
    ) -> None:
        await kafka.publish(self.url, channel, messages, partition=partition)

    def transport(self, **options: Any) -> Transport:
        return kafka.KafkaTransport(self.url, **options)

    async def dead_letters(self, channel: str) -> list[dict[str, Any]]:
        return await kafka.peek_dead_letters(self.url, channel, limit=100)

    async def replay(self, channel: str, release: Release) -> list[dict[str, Any]]:
        return await kafka.replay_dead_letters(self.url, channel, limit=100, release=release)

    async def backlog(self, channel: str) -> int:
        """The group's lag on the channel and its retry topics (RabbitMQ: its delay queues)."""
        return await kafka.backlog(self.url, channel, self.group_id, with_retry_topics=True)

    async def ready(self, channel: str, *transports: Transport, timeout_s: float = 30) -> None:
        workers = [t for t in transports if isinstance(t, kafka.KafkaTransport)]
        partitions = kafka.KafkaOptions.from_url(self.url).partitions
        async with asyncio.timeout(timeout_s):
            while True:
                # The channel's own partitions (a worker is assigned its retry topics' too).
                owned = [{tp for tp in w.assignment if tp.topic == channel} for w in workers]
                spread = all(owned) or len(workers) > partitions
                if spread and sum(len(o) for o in owned) == partitions:
                    return
                await asyncio.sleep(0.05)
