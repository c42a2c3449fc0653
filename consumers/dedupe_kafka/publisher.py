"""Writing to Kafka: topic creation, the idempotent acks=all producer, the publisher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
)

from dedupe.claims.keys import MESSAGE_ID_HEADER
from dedupe.errors import BrokerUnavailable, ConfigurationError
from dedupe.transport import dlq_name
from dedupe_kafka.options import KafkaOptions

logger = logging.getLogger(__name__)

# What aiokafka raises when no broker answers (at start, for metadata, or for a send's ack):
# the publisher says BrokerUnavailable, as RabbitMQ's does, so that the outbox relay waits as a
# whole instead of counting a refusal against each row.
_UNREACHABLE = (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
    OSError,
)


@contextlib.asynccontextmanager
async def admin_client(options: KafkaOptions) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=options.bootstrap_servers,
        client_id=options.client_id,
        request_timeout_ms=15_000,
    )
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def ensure_topics(options: KafkaOptions, names: Iterable[str]) -> None:
    """Create the topics that do not exist yet (broker auto-creation may race consumers)."""
    async with admin_client(options) as admin:
        existing = set(await admin.list_topics())
        missing = sorted(set(names) - existing)
        if not missing:
            return
        replication = options.replication_factor
        if replication < 1:
            brokers = (await admin.describe_cluster()).get("brokers") or [None]
            replication = min(3, len(brokers))
        response = await admin.create_topics(
            [NewTopic(name, options.partitions, replication) for name in missing]
        )
        for topic, code, *rest in response.topic_errors:
            if code and code != TopicAlreadyExistsError.errno:
                raise ConfigurationError(
                    f"cannot create Kafka topic {topic!r}: error {code} {rest[0] if rest else ''}"
                )
        logger.info(
            "created Kafka topics %s (%d partitions)", ", ".join(missing), options.partitions
        )


def encode_headers(headers: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    return [
        (str(name), value if isinstance(value, bytes) else str(value).encode())
        for name, value in headers.items()
        if value is not None
    ]


async def idempotent_producer(options: KafkaOptions) -> AIOKafkaProducer:
    """The idempotent acks=all producer, started (and stopped again if it could not start)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=options.bootstrap_servers,
        client_id=options.client_id,
        enable_idempotence=True,
        acks="all",
        linger_ms=1,
        max_request_size=options.max_request_size,
    )
    try:
        await producer.start()
    except BaseException:
        await producer.stop()
        raise
    return producer


class KafkaPublisher:
    """Publishes to channels (topics) with an idempotent producer and acks=all: `publish`
    returns once every in-sync replica has the record. Implements dedupe.transport.Publisher.

    The message id travels in the `message-id` header (what `key="message_id"` reads) and, by
    default, as the record key, so that copies of one message land in one partition.
    """

    def __init__(self, url: str, **options: Any) -> None:
        self.options = KafkaOptions.from_url(url, **options)
        # The receiver fits its body limit under this (dedupe_receiver.limits).
        self.max_message_bytes = self.options.max_request_size
        self._producer: AIOKafkaProducer | None = None
        self._topics: set[str] = set()
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> KafkaPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        async with self._lock:
            if self._producer is None:
                try:
                    self._producer = await idempotent_producer(self.options)
                except _UNREACHABLE as exc:
                    raise self._unavailable(exc) from exc

    def _unavailable(self, exc: BaseException) -> BrokerUnavailable:
        return BrokerUnavailable(
            f"cannot reach Kafka at {self.options.bootstrap_servers} "
            f"({exc.__class__.__name__}: {exc})"
        )

    async def publish(
        self,
        channel: str,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str],
        key: bytes | None = None,
    ) -> None:
        future = await self.send(
            channel, body, message_id=message_id, headers=headers, key=key or message_id.encode()
        )
        try:
            await future
        except _UNREACHABLE as exc:
            raise self._unavailable(exc) from exc

    async def send(
        self,
        channel: str,
        body: bytes,
        *,
        message_id: str | None,
        headers: Mapping[str, Any],
        key: bytes | None = None,
        partition: int | None = None,
    ) -> asyncio.Future[Any]:
        """Queue one record; the returned future resolves when the broker has it."""
        await self.start()
        assert self._producer is not None
        record_headers = encode_headers(headers)
        if message_id is not None:
            record_headers.insert(0, (MESSAGE_ID_HEADER, message_id.encode()))
        try:
            if channel not in self._topics:
                await ensure_topics(self.options, [channel, dlq_name(channel)])
                self._topics.add(channel)
            future: asyncio.Future[Any] = await self._producer.send(
                channel, value=body, key=key, headers=record_headers, partition=partition
            )
        except _UNREACHABLE as exc:
            raise self._unavailable(exc) from exc
        return future

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()


async def publish(
    url: str,
    channel: str,
    messages: Sequence[tuple[bytes, Mapping[str, Any], str | None]],
    *,
    partition: int | None = None,
) -> int:
    """Publish (body, headers, message_id) triples, acknowledged by all in-sync replicas.

    The message id is the record key (None: the partitioner spreads them); `partition` pins
    every record to one partition.
    """
    async with KafkaPublisher(url) as publisher:
        pending = [
            await publisher.send(
                channel,
                body,
                message_id=message_id,
                headers=headers,
                key=message_id.encode() if message_id is not None else None,
                partition=partition,
            )
            for body, headers, message_id in messages
        ]
        await asyncio.gather(*pending)
    return len(messages)
