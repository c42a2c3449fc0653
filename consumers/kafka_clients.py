"""Kafka clients besides the consumer: options from the URL, topic creation, the idempotent
publisher, and read-only inspection of dead letters and of a group's backlog."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

try:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import KafkaError, TopicAlreadyExistsError
    from aiokafka.structs import TopicPartition
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the Kafka transport needs aiokafka: pip install 'dedupe-worker[kafka]'"
    ) from exc

from dedupe.errors import ConfigurationError
from dedupe.keys import MESSAGE_ID_HEADER
from dedupe.message import Headers
from dedupe.replay import Release, ReplayPolicy, describe
from dedupe.transport import BODY_DROPPED_HEADER, dlq_name

logger = logging.getLogger(__name__)

# Where a dead letter came from: "<topic>/<partition>/<offset>".
ORIGIN_HEADER = "x-dedupe-origin"
# The transport adds the origin besides the dead-letter headers; a replay strips both.
REPLAY = ReplayPolicy(own_headers=(ORIGIN_HEADER,))


@dataclass(frozen=True, kw_only=True)
class KafkaOptions:
    """How the transport talks to Kafka; every field but the servers may be set in the URL
    (`kafka://host:9092,host2:9092?group_id=billing&partitions=8`)."""

    bootstrap_servers: str
    group_id: str = "dedupe-worker"
    client_id: str = "dedupe-worker"
    partitions: int = 4  # for topics this transport creates
    replication_factor: int = 0  # for topics it creates; 0 = min(3, brokers in the cluster)
    batch_max: int = 64  # messages per process() call (one claim statement)
    max_held: int = 1000  # deferred messages kept per partition before it stops fetching
    commit_interval_s: float = 0.2
    revoke_timeout_s: float = 10.0
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000
    fetch_max_wait_ms: int = 100
    # The largest request the producer sends (aiokafka's max_request_size): caps dead letters
    # and the receiver's messages. Raise it with the topic's max.message.bytes.
    max_request_size: int = 1_048_576

    @classmethod
    def from_url(cls, url: str, **defaults: Any) -> KafkaOptions:
        """Parse `kafka://servers?option=value`; URL options win over `defaults`."""
        parts = urlsplit(url)
        if parts.scheme != "kafka" or not parts.netloc:
            raise ConfigurationError(f"expected kafka://host:port[,host:port...], got {url!r}")
        types = {f.name: f.type for f in fields(cls) if f.name != "bootstrap_servers"}
        values: dict[str, Any] = dict(defaults)
        for name, raw in parse_qsl(parts.query, keep_blank_values=True):
            if name not in types:
                raise ConfigurationError(
                    f"unknown Kafka option {name!r} in the broker URL; known: {', '.join(types)}"
                )
            convert = {"int": int, "float": float}.get(str(types[name]), str)
            try:
                values[name] = convert(raw)
            except ValueError as exc:
                raise ConfigurationError(f"Kafka option {name}={raw!r}: {exc}") from exc
        options = cls(bootstrap_servers=parts.netloc, **values)
        options.check()
        return options

    def check(self) -> None:
        for name in (
            "partitions",
            "batch_max",
            "max_held",
            "heartbeat_interval_ms",
            "max_request_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"Kafka option {name} must be at least 1")
        if self.commit_interval_s <= 0 or self.revoke_timeout_s < 0:
            raise ConfigurationError("commit_interval_s must be > 0 and revoke_timeout_s >= 0")
        if not self.group_id:
            raise ConfigurationError("Kafka option group_id must not be empty")


def group_id_for(app_name: str) -> str:
    """The consumer group of an app's workers, unless the URL names one."""
    return f"dedupe-{app_name}"


# -- topics ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _admin(options: KafkaOptions) -> AsyncIterator[AIOKafkaAdminClient]:
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
    async with _admin(options) as admin:
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


def idempotent_producer(options: KafkaOptions) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=options.bootstrap_servers,
        client_id=options.client_id,
        enable_idempotence=True,
        acks="all",
        linger_ms=1,
        max_request_size=options.max_request_size,
    )


# -- publishing -----------------------------------------------------------------------------


class KafkaPublisher:
    """Publishes to channels (topics) with an idempotent producer and acks=all: `publish`
    returns once every in-sync replica has the record. Implements dedupe.transport.Publisher.

    The message id travels in the `message-id` header (what `key="message_id"` reads) and, by
    default, as the record key, so that copies of one message land in one partition.
    """

    def __init__(self, url: str, **options: Any) -> None:
        self.options = KafkaOptions.from_url(url, **options)
        # The receiver fits its body limit under this (consumers.receiver_limits).
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
                producer = idempotent_producer(self.options)
                try:
                    await producer.start()
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer

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
        await future

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
        if channel not in self._topics:
            await ensure_topics(self.options, [channel, dlq_name(channel)])
            self._topics.add(channel)
        assert self._producer is not None
        record_headers = encode_headers(headers)
        if message_id is not None:
            record_headers.insert(0, (MESSAGE_ID_HEADER, message_id.encode()))
        future: asyncio.Future[Any] = await self._producer.send(
            channel, value=body, key=key, headers=record_headers, partition=partition
        )
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


async def delete_channels(url: str, channels: Iterable[str]) -> int:
    """Delete each channel's topics (C and C.dlq) that exist; returns how many were deleted.

    For tests, benchmarks and operators tidying up channels that are gone.
    """
    options = KafkaOptions.from_url(url)
    async with _admin(options) as admin:
        existing = set(await admin.list_topics())
        doomed = sorted({n for c in channels for n in (c, dlq_name(c))} & existing)
        if doomed:
            await admin.delete_topics(doomed)
    return len(doomed)


# -- inspection (tests, demo, operators) ----------------------------------------------------


@contextlib.asynccontextmanager
async def _reader(options: KafkaOptions) -> AsyncIterator[AIOKafkaConsumer]:
    """A consumer outside any group (reads only what it is assigned)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=options.bootstrap_servers,
        client_id=options.client_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


async def partitions_of(admin: AIOKafkaAdminClient, topic: str) -> list[TopicPartition]:
    """The topic's partitions; none if it does not exist (and without auto-creating it)."""
    if topic not in await admin.list_topics():
        return []
    [described] = await admin.describe_topics([topic])
    return sorted(TopicPartition(topic, p["partition"]) for p in described["partitions"])


async def group_offsets(
    admin: AIOKafkaAdminClient, group_id: str, tps: list[TopicPartition], *, within_s: float = 30
) -> dict[TopicPartition, Any]:
    """The group's committed offsets, waiting out a coordinator that is not there yet (a fresh
    broker creates __consumer_offsets on the first group lookup and answers
    COORDINATOR_NOT_AVAILABLE until it has)."""
    deadline = time.monotonic() + within_s
    delay = 0.2
    while True:
        try:
            offsets: dict[TopicPartition, Any] = await admin.list_consumer_group_offsets(
                group_id, partitions=tps
            )
            return offsets
        except KafkaError as exc:
            if not exc.retriable or time.monotonic() + delay > deadline:
                raise
            logger.info("group coordinator for %s not ready (%s); retrying", group_id, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def replay_group(channel: str) -> str:
    """The consumer group whose committed offsets on <channel>.dlq mark what was replayed."""
    return f"dedupe-dlq-replay.{channel}"


async def _replay_positions(
    admin: AIOKafkaAdminClient, channel: str
) -> tuple[list[TopicPartition], dict[TopicPartition, int]]:
    """<channel>.dlq's partitions and, per partition, the first offset not yet replayed."""
    tps = await partitions_of(admin, dlq_name(channel))
    if not tps:
        return [], {}
    committed = await group_offsets(admin, replay_group(channel), tps)
    return tps, {
        tp: meta.offset for tp, meta in committed.items() if meta is not None and meta.offset >= 0
    }


async def _read_dead_letters(
    consumer: AIOKafkaConsumer,
    tps: list[TopicPartition],
    starts: Mapping[TopicPartition, int],
    *,
    limit: int,
) -> list[Any]:
    """Up to `limit` records of the dead-letter partitions from `starts` (else the beginning)."""
    consumer.assign(tps)
    ends = await consumer.end_offsets(tps)
    firsts = await consumer.beginning_offsets(tps)
    for tp in tps:
        consumer.seek(tp, max(starts.get(tp, 0), firsts[tp]))
    remaining = {tp for tp in tps if ends[tp] > await consumer.position(tp)}
    found: list[Any] = []
    deadline = time.monotonic() + 15
    while remaining and len(found) < limit and time.monotonic() < deadline:
        batches = await consumer.getmany(*remaining, timeout_ms=200)
        for tp, records in batches.items():
            found.extend(r for r in records if r.offset < ends[tp])
            if await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)
    return found[:limit]


async def _pending_dead_letters(options: KafkaOptions, channel: str, *, limit: int) -> list[Any]:
    """Up to `limit` records of <channel>.dlq from where the replay group left off."""
    async with _admin(options) as admin:
        tps, starts = await _replay_positions(admin, channel)
    if not tps:
        return []
    async with _reader(options) as consumer:
        return await _read_dead_letters(consumer, tps, starts, limit=limit)


async def peek_dead_letters(url: str, channel: str, *, limit: int) -> list[dict[str, Any]]:
    """Read up to `limit` dead letters of a channel not replayed yet (see replay_dead_letters)."""
    records = await _pending_dead_letters(KafkaOptions.from_url(url), channel, limit=limit)
    return [_describe_dead_letter(record) for record in records]


async def replay_dead_letters(
    url: str, channel: str, *, limit: int, release: Release | None = None
) -> list[dict[str, Any]]:
    """Publish up to `limit` dead letters of <channel>.dlq back to the channel.

    A dead-letter topic is a log, so nothing is removed: what was replayed is marked by the
    committed offsets of the group `dedupe-dlq-replay.<channel>`, committed once every
    republished record is acknowledged by all in-sync replicas. `release(scope, key)` runs
    first for each record whose own claim failed (see dedupe.transport.claim_to_release), so
    that the claim is claimable again by the time a worker sees it. Interrupted between the
    publish and the commit, the next replay publishes those records again; the claims make the
    second copy a duplicate. A dead letter written without its body cannot run again: it is
    skipped with a WARNING naming its origin and why the body was dropped; it stays in the
    topic, but the replay group moves past it, so `dlq list` no longer shows it.
    """
    options = KafkaOptions.from_url(url)
    records = await _pending_dead_letters(options, channel, limit=limit)
    if not records:
        return []
    moved: list[dict[str, Any]] = []
    async with KafkaPublisher(url) as publisher:
        pending = []
        for record in records:
            described = _describe_dead_letter(record)
            step = REPLAY.plan(dict(record.headers or ()), message_id=described["message_id"])
            if step.skipped is not None:
                logger.warning(
                    "not replaying %s/%d/%d (from %s): %s",
                    record.topic,
                    record.partition,
                    record.offset,
                    described["origin"],
                    step.skipped,
                    extra={k: described[k] for k in ("scope", "key", "message_id", "reason")},
                )
                continue

            async def send(headers: dict[str, Any], record: Any = record) -> asyncio.Future[Any]:
                message_id = headers.pop(MESSAGE_ID_HEADER, None)
                return await publisher.send(
                    channel,
                    record.value or b"",
                    message_id=message_id.decode() if message_id is not None else None,
                    headers=headers,
                    key=record.key,
                )

            sent = await step.carry_out(release=release, republish=send)
            assert sent is not None  # not skipped
            pending.append(sent)
            moved.append(step.row)
        await asyncio.gather(*pending)
    done: dict[TopicPartition, int] = {}
    for record in records:
        tp = TopicPartition(record.topic, record.partition)
        done[tp] = max(done.get(tp, 0), record.offset + 1)
    committer = AIOKafkaConsumer(
        bootstrap_servers=options.bootstrap_servers,
        client_id=options.client_id,
        group_id=replay_group(channel),
        enable_auto_commit=False,
    )
    await committer.start()
    try:
        committer.assign(list(done))
        await committer.commit(done)
    finally:
        await committer.stop()
    return moved


def _describe_dead_letter(record: Any) -> dict[str, Any]:
    headers = Headers(dict(record.headers or ()))
    return {
        **describe(headers, message_id=headers.get(MESSAGE_ID_HEADER)),
        "origin": headers.get(ORIGIN_HEADER),
        "body_dropped": headers.get(BODY_DROPPED_HEADER),
        "record_key": record.key,
        "headers": dict(headers),
        "bytes": len(record.value or b""),
    }


async def backlog(url: str, channel: str, group_id: str) -> int:
    """Records of `channel` the group has not committed past yet (its lag)."""
    options = KafkaOptions.from_url(url)
    async with _admin(options) as admin:
        tps = await partitions_of(admin, channel)
        if not tps:
            return 0
        committed = await group_offsets(admin, group_id, tps)
    async with _reader(options) as consumer:
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
    total = 0
    for tp in tps:
        done = committed.get(tp)
        position = max(done.offset if done is not None else -1, starts[tp])
        total += max(ends[tp] - position, 0)
    return total


def with_options(url: str, **options: Any) -> str:
    """The URL with `?option=value` pairs added (e.g. a test's own group id)."""
    query = urlencode(options)
    return f"{url}{'&' if '?' in url else '?'}{query}" if query else url


__all__ = [
    "BODY_DROPPED_HEADER",
    "ORIGIN_HEADER",
    "KafkaOptions",
    "KafkaPublisher",
    "backlog",
    "ensure_topics",
    "group_id_for",
    "peek_dead_letters",
    "publish",
    "with_options",
]
