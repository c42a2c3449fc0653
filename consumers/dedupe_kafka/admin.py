"""Kafka for operators and tests: peek at and replay dead letters, a group's lag, delete topics.

Read-only but for the replay, which publishes and commits the replay group's offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from dedupe.claims.keys import MESSAGE_ID_HEADER
from dedupe.message import Headers
from dedupe.operations.replay import Release, ReplayPolicy, describe
from dedupe.transport import BODY_DROPPED_HEADER, dlq_name
from dedupe_kafka.options import KafkaOptions
from dedupe_kafka.publisher import KafkaPublisher, admin_client, publish
from dedupe_kafka.retries import ORIGIN_HEADER, RETRY_HEADERS, retry_topics

logger = logging.getLogger(__name__)

# The transport adds the origin besides the dead-letter headers; a replay strips both (and the
# retry topics' headers, which a dead letter does not carry).
REPLAY = ReplayPolicy(own_headers=RETRY_HEADERS)


async def delete_channels(url: str, channels: Iterable[str]) -> int:
    """Delete each channel's topics (C, C.dlq and the retry topics C.retry.<bucket>) that
    exist; returns how many were deleted.

    For tests, benchmarks and operators tidying up channels that are gone.
    """
    options = KafkaOptions.from_url(url)
    async with admin_client(options) as admin:
        existing = set(await admin.list_topics())
        names = {n for c in channels for n in (c, dlq_name(c), *retry_topics(c))}
        doomed = sorted(names & existing)
        if doomed:
            await admin.delete_topics(doomed)
    return len(doomed)


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
    async with admin_client(options) as admin:
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


async def backlog(url: str, channel: str, group_id: str, *, with_retry_topics: bool = False) -> int:
    """Records of `channel` the group has not committed past yet (its lag); with
    `with_retry_topics`, those of the channel's retry topics too (deferred messages)."""
    topics = [channel, *retry_topics(channel)] if with_retry_topics else [channel]
    options = KafkaOptions.from_url(url)
    async with admin_client(options) as admin:
        existing = set(await admin.list_topics())
        names = [topic for topic in topics if topic in existing]
        if not names:
            return 0
        tps = sorted(
            TopicPartition(described["topic"], p["partition"])
            for described in await admin.describe_topics(names)
            for p in described["partitions"]
        )
        committed = await group_offsets(admin, group_id, tps)
    async with _reader(options) as consumer:
        # Assigned first, the reader learns every topic's leaders in one metadata round (asked
        # offsets of topics it does not know, aiokafka learns them one topic per 100 ms backoff).
        consumer.assign(tps)
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
    total = 0
    for tp in tps:
        done = committed.get(tp)
        position = max(done.offset if done is not None else -1, starts[tp])
        total += max(ends[tp] - position, 0)
    return total


class KafkaAdmin:
    """The operator's client for one Kafka URL (dedupe.plugins.BrokerAdmin)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def peek_dead_letters(self, channel: str, *, limit: int) -> list[dict[str, Any]]:
        return await peek_dead_letters(self.url, channel, limit=limit)

    async def replay_dead_letters(
        self, channel: str, *, limit: int, release: Release | None = None
    ) -> list[dict[str, Any]]:
        return await replay_dead_letters(self.url, channel, limit=limit, release=release)

    async def publish(
        self, channel: str, messages: Sequence[tuple[bytes, Mapping[str, Any], str | None]]
    ) -> int:
        return await publish(self.url, channel, messages)

    async def delete_channels(self, channels: Sequence[str]) -> int:
        return await delete_channels(self.url, channels)
