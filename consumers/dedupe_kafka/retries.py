"""Kafka retry topics: a deferral of a few seconds or more waits on the broker, not in memory.

Kafka cannot redeliver one record later, so a record whose run the core defers for at least the
smallest delay bucket (dedupe.transport.DELAY_BUCKETS: 5 s) is copied to the retry topic of its
bucket, `<channel>.retry.<bucket>` (`5s`, `30s`, `2m`, `10m`, `1h`), and its own offset is
done once the broker has the copy (idempotent producer, acks=all): its partition commits past
it at once. The copy keeps the record key, the body and the headers, and carries

- `x-dedupe-deferrals`: the attempt that was deferred (the copy's attempt is one more),
- `x-dedupe-due-at`: when it may run, in epoch milliseconds,
- `x-dedupe-origin`: `<topic>/<partition>/<offset>` of the original record, so that the copy
  runs as a message of its channel (same handler, scope and key, `kafka:offset` keys too) and
  its dead letter goes to `<channel>.dlq`.

The worker consumes the retry topics of its channels in its group; a retry partition runs one
fetched batch at a time and is not polled while that batch waits for its records to be due
(dedupe_kafka.partition), so a copy never runs early and a wait is bounded by its bucket's
bound. Like Spring Kafka's non-blocking retries, a record sent to a retry topic no longer holds
back the later records of its key: they run before it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from dedupe.message import Message
from dedupe.transport import (
    DEFERRALS_HEADER,
    DELAY_BUCKETS,
    Action,
    Settlement,
    delay_bucket,
)

logger = logging.getLogger(__name__)

# ConsumerRecord (duck-typed).
ConsumerRecord = Any

# When a copy in a retry topic may run (epoch milliseconds).
DUE_AT_HEADER = "x-dedupe-due-at"
# Where a dead letter or a retry copy came from: "<topic>/<partition>/<offset>" (the dead
# letters' header: dedupe_kafka.dead_letters).
ORIGIN_HEADER = "x-dedupe-origin"
# The headers a retry copy carries of ours; a copy of a copy gets them anew.
RETRY_HEADERS = (DEFERRALS_HEADER, DUE_AT_HEADER, ORIGIN_HEADER)

_LABELS = {label: bound for bound, label in DELAY_BUCKETS}
_INFIX = ".retry."


def retry_topic(channel: str, delay_s: float) -> str:
    """The retry topic a deferral of `delay_s` waits in: the smallest bucket that covers it."""
    return f"{channel}{_INFIX}{delay_bucket(delay_s)[1]}"


def retry_topics(channel: str) -> list[str]:
    """Every retry topic of a channel, shortest bucket first."""
    return [f"{channel}{_INFIX}{label}" for _, label in DELAY_BUCKETS]


def retry_bucket(topic: str) -> tuple[str, float] | None:
    """(channel, bucket bound in seconds) of a retry topic; None for any other topic."""
    channel, infix, label = topic.rpartition(_INFIX)
    if not infix or not channel or label not in _LABELS:
        return None
    return channel, _LABELS[label]


def goes_to_retry_topic(settlement: Settlement) -> bool:
    """A deferral long enough to wait on the broker (at least the smallest bucket's bound)."""
    return settlement.action is Action.DEFER and settlement.delay_s >= DELAY_BUCKETS[0][0]


def origin_of(record: ConsumerRecord) -> tuple[str, int, int]:
    """(topic, partition, offset) of the original record: a retry copy's origin header, where
    it names the channel of the retry topic the copy is in; else the record's own."""
    bucket = retry_bucket(record.topic)
    if bucket is not None:
        raw = dict(record.headers or ()).get(ORIGIN_HEADER)
        if raw is not None:
            topic, _, rest = raw.decode("utf-8", "replace").partition("/")
            partition, _, offset = rest.partition("/")
            if topic == bucket[0] and partition.isdigit() and offset.isdigit():
                return topic, int(partition), int(offset)
        return bucket[0], record.partition, record.offset
    return record.topic, record.partition, record.offset


def deferrals_of(record: ConsumerRecord) -> int:
    """How many times a retry copy was deferred (0 for a record that is no copy)."""
    raw = dict(record.headers or ()).get(DEFERRALS_HEADER)
    try:
        return max(int(raw), 0) if raw is not None else 0
    except ValueError:
        return 0


# A due time further ahead than this is not a deferral we wrote (a clock far off, a hostile
# header): such a copy runs at its bucket's bound instead of travelling on.
LONGEST_WAIT_S = 7 * 24 * 3600.0
# A copy due within this of its bucket's bound runs then rather than travelling once more.
CARRY_SLACK_S = 1.0


def _due_header(record: ConsumerRecord) -> float | None:
    raw = dict(record.headers or ()).get(DUE_AT_HEADER)
    try:
        return int(raw) / 1000 if raw is not None else None
    except ValueError:
        return None


def still_waiting(record: ConsumerRecord, now: float) -> float:
    """Seconds a copy that its bucket's bound made due must still wait (0: run it now).

    A deferral longer than the last bucket (1 h) waits there an hour at a time: at the bound
    it is copied on (Retries.carry_on) until its due time, as RabbitMQ's 1 h queue keeps its
    message the whole delay."""
    due = _due_header(record)
    if due is None:
        return 0.0
    left = due - now
    return left if CARRY_SLACK_S < left <= LONGEST_WAIT_S else 0.0


def due_at(record: ConsumerRecord, bound_s: float) -> float:
    """When (epoch seconds) a retry copy may run: its due header, but never later than its
    bucket's bound after it was written (a clock far ahead, or a hostile header, waits no
    longer than the bucket)."""
    written = record.timestamp / 1000 if record.timestamp else time.time()
    latest = written + bound_s
    raw = dict(record.headers or ()).get(DUE_AT_HEADER)
    try:
        due = int(raw) / 1000 if raw is not None else written
    except ValueError:
        due = written
    return min(due, latest)


def retry_headers(
    record: ConsumerRecord, attempt: int, due_ms: int, origin: tuple[str, int, int]
) -> list[tuple[str, bytes]]:
    """The copy's headers: the record's (without our retry headers of an earlier trip), then
    the deferred attempt, the due time and the origin."""
    headers = [(k, v) for k, v in record.headers or () if k not in RETRY_HEADERS]
    topic, partition, offset = origin
    headers += [
        (DEFERRALS_HEADER, str(attempt).encode()),
        (DUE_AT_HEADER, str(due_ms).encode()),
        (ORIGIN_HEADER, f"{topic}/{partition}/{offset}".encode()),
    ]
    return headers


class Retries:
    """Writes deferred records to their retry topics with the transport's idempotent producer
    (None while it is closed)."""

    # How long a copy may take to be acknowledged before the record is held in memory instead.
    timeout_s = 10.0

    def __init__(self, producer: Callable[[], AIOKafkaProducer | None]) -> None:
        self._producer = producer
        self.sent = 0

    async def send(self, record: ConsumerRecord, message: Message, settlement: Settlement) -> bool:
        """Copy the record to the retry topic of its delay; True once the broker has it.

        One try, bounded by `timeout_s`: any failure gives False and the partition holds the
        message in memory as it did before retry topics (nothing is lost; a copy the broker did
        take although the send reported a failure runs later, a duplicate by the claims).
        """
        origin = origin_of(record)
        topic = retry_topic(origin[0], settlement.delay_s)
        due_ms = int((time.time() + settlement.delay_s) * 1000)
        failed = await self._write(
            record, topic, retry_headers(record, message.attempt, due_ms, origin)
        )
        if failed is not None:
            logger.warning(
                "could not write the deferral of %s to %s (%s); holding it in memory",
                _where(record),
                topic,
                failed,
                extra={"message_id": message.message_id, "channel": origin[0]},
            )
            return False
        logger.debug("deferred %s to %s for %.1fs", _where(record), topic, settlement.delay_s)
        return True

    async def carry_on(self, record: ConsumerRecord, wait_s: float) -> bool:
        """Copy a retry topic's record that is not due yet to the retry topic of the wait left,
        its headers as they are (the same deferral count, due time and origin); True once the
        broker has it. False: the caller runs it now (at its bucket's bound, as before)."""
        topic = retry_topic(origin_of(record)[0], wait_s)
        failed = await self._write(record, topic, list(record.headers or ()))
        if failed is not None:
            logger.warning(
                "could not carry %s on to %s (%s); it runs now, %.0f s before it is due",
                _where(record),
                topic,
                failed,
                wait_s,
            )
            return False
        logger.debug("carried %s on to %s, %.0f s still to wait", _where(record), topic, wait_s)
        return True

    async def _write(
        self, record: ConsumerRecord, topic: str, headers: list[tuple[str, bytes]]
    ) -> str | None:
        """Write the record's copy with these headers, one try bounded by `timeout_s`; None
        once the broker has it, else what went wrong."""
        producer = self._producer()
        try:
            if producer is None:
                raise KafkaError("the transport is closed")
            async with asyncio.timeout(self.timeout_s):
                await producer.send_and_wait(
                    topic, value=record.value, key=record.key, headers=headers
                )
        except TimeoutError as exc:
            return exc.__class__.__name__
        except KafkaError as exc:
            return str(exc)
        self.sent += 1
        return None


def _where(record: ConsumerRecord) -> str:
    return "/".join(map(str, (record.topic, record.partition, record.offset)))


def topics_of(channels: Iterable[str]) -> list[str]:
    """The retry topics of these channels."""
    return [topic for channel in channels for topic in retry_topics(channel)]
