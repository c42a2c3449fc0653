"""The Kafka transport's own loops without a broker: periodic commits and dead-letter writes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    MessageSizeTooLargeError,
    PolicyViolationError,
)

from dedupe.claims.records import Reason
from dedupe.transport import BODY_DROPPED_HEADER, Action, Settlement
from dedupe_kafka import transport as transport_module
from dedupe_kafka.partition import PartitionWork
from dedupe_kafka.transport import FULL_PAUSE_S, KafkaTransport

DEAD = Settlement(
    Action.DEAD_LETTER, reason=Reason.HANDLER_ERROR, detail="boom", scope="t.work", key="k1"
)


@dataclass(frozen=True)
class Record:
    value: bytes | None = b"x" * 100
    key: bytes | None = b"k1"
    headers: tuple[tuple[str, bytes], ...] = (("message-id", b"m-1"),)
    topic: str = "orders"
    partition: int = 0
    offset: int = 7


@dataclass
class Producer:
    """Answers each send with the next of `errors` (None: the broker has the record)."""

    errors: list[Exception | None]
    sent: list[dict[str, Any]] = field(default_factory=list)

    async def send_and_wait(self, topic: str, **record: Any) -> None:
        self.sent.append({"topic": topic, **record})
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error


def transport_with(producer: Producer) -> KafkaTransport:
    transport = KafkaTransport("kafka://127.0.0.1:9092")
    transport._producer = producer
    return transport


def never_closing() -> bool:
    return False


async def test_the_commit_loop_goes_on_after_an_unexpected_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug in one commit is logged; the periodic commits do not stop silently."""
    transport = KafkaTransport("kafka://127.0.0.1:9092?commit_interval_s=0.01")
    commits: list[int] = []
    third = asyncio.Event()

    async def commit(work: Sequence[PartitionWork]) -> None:
        commits.append(len(commits))
        if len(commits) == 1:
            raise RuntimeError("a bug")
        if len(commits) == 3:
            third.set()

    transport._commit = commit  # type: ignore[method-assign]
    loop = asyncio.create_task(transport._commit_loop())
    try:
        async with asyncio.timeout(2):
            await third.wait()
        assert not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert "committing offsets failed unexpectedly" in caplog.text


async def test_a_dead_letter_write_is_retried_while_the_error_is_transient() -> None:
    producer = Producer([KafkaConnectionError(), None])
    transport = transport_with(producer)
    assert await transport.dead_letters.send(Record(), DEAD, never_closing)
    assert len(producer.sent) == 2
    assert producer.sent[-1]["value"] == b"x" * 100


async def test_a_dead_letter_too_large_for_the_broker_goes_out_without_its_body(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Headers, origin and reason kept, plus a header saying the body was dropped and why."""
    producer = Producer([MessageSizeTooLargeError("1048700 bytes"), None])
    transport = transport_with(producer)
    assert await transport.dead_letters.send(Record(), DEAD, never_closing)
    full, bodiless = producer.sent
    assert (full["value"], bodiless["value"]) == (b"x" * 100, b"")
    assert bodiless["topic"] == "orders.dlq" and bodiless["key"] == b"k1"
    headers = dict(bodiless["headers"])
    assert headers["message-id"] == b"m-1"
    assert headers["x-dedupe-reason"] == b"handler_error"
    assert headers["x-dedupe-origin"] == b"orders/0/7"
    assert headers[BODY_DROPPED_HEADER].startswith(b"100 bytes: ")
    assert b"MessageSizeTooLargeError" in headers[BODY_DROPPED_HEADER]
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "without its 100-byte body" in error.getMessage()
    assert (error.scope, error.key, error.message_id) == ("t.work", "k1", "m-1")  # type: ignore[attr-defined]


async def test_a_dead_letter_that_can_never_be_written_is_refused_loudly_not_retried_in_a_spin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two tries (with the body, without it), two ERROR lines, then False: the partition
    holds the message and tries again later (see test_kafka_partition)."""
    too_large = MessageSizeTooLargeError("too large")
    producer = Producer([too_large, too_large, too_large])
    transport = transport_with(producer)
    async with asyncio.timeout(1):
        assert not await transport.dead_letters.send(Record(), DEAD, never_closing)
    assert len(producer.sent) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert "even without its body" in errors[1]


async def test_a_dead_letter_refused_for_another_reason_keeps_its_body_and_is_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only a size refusal drops the body; a policy or a bad record: one try, one ERROR,
    False (the partition holds the message and tries again later with its body)."""
    producer = Producer([PolicyViolationError("not allowed"), None])
    transport = transport_with(producer)
    async with asyncio.timeout(1):
        assert not await transport.dead_letters.send(Record(), DEAD, never_closing)
    assert [sent["value"] for sent in producer.sent] == [b"x" * 100]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "was refused" in errors[0]


async def test_a_revoked_partition_stops_retrying_its_dead_letter() -> None:
    producer = Producer([KafkaConnectionError()] * 100)
    transport = transport_with(producer)
    async with asyncio.timeout(1):
        assert not await transport.dead_letters.send(Record(), DEAD, lambda: True)
    assert len(producer.sent) == 1


@dataclass
class Slots:
    """What the transport's polling reads of a partition (dedupe_kafka.partition.PartitionWork)."""

    full: bool = False
    closing: bool = False
    # Full from a moment that never counts as long ago unless a test says so: no timing here.
    full_since: float = field(default_factory=lambda: time.monotonic() + 3600)
    last_full_s: float = 0.0


@dataclass
class Consumer:
    """aiokafka's pause, resume and paused() (a flag per partition: pausing twice and resuming
    once leaves it unpaused), with the calls kept in order."""

    pauses: list[str] = field(default_factory=list)
    resumes: list[str] = field(default_factory=list)
    _paused: set[str] = field(default_factory=set)

    def pause(self, tp: str) -> None:
        self.pauses.append(tp)
        self._paused.add(tp)

    def resume(self, tp: str) -> None:
        self.resumes.append(tp)
        self._paused.discard(tp)

    def paused(self) -> set[str]:
        return set(self._paused)


def polling(**partitions: Slots) -> tuple[KafkaTransport, Consumer]:
    transport = KafkaTransport("kafka://127.0.0.1:9092")
    consumer = Consumer()
    transport._consumer = consumer
    transport._partitions = dict(partitions)  # type: ignore[arg-type]
    return transport, consumer


async def test_a_partition_just_full_is_left_out_of_the_poll_not_paused() -> None:
    """A pause would make aiokafka drop what it fetched ahead for the partition (fetched again
    on resume: Kafka duplicates ran at half their rate); it is only not asked for."""
    transport, consumer = polling(a=Slots(full=True), b=Slots(), c=Slots(closing=True))
    assert await transport._open_partitions() == ["b"]
    assert consumer.pauses == []
    transport, consumer = polling()  # nothing assigned yet: poll every partition
    assert await transport._open_partitions() == []


async def test_a_partition_full_for_long_is_paused_and_polled() -> None:
    """Its buffered records would hold back the broker's next fetch for the other partitions:
    paused and polled, so that aiokafka drops them; polled again while paused (a paused
    partition returns nothing), until a batch ends and resumes it."""
    long_ago = time.monotonic() - FULL_PAUSE_S
    transport, consumer = polling(a=Slots(full=True, full_since=long_ago), b=Slots(full=True))
    assert await transport._open_partitions() == ["a"]
    assert consumer.pauses == ["a"]
    assert await transport._open_partitions() == ["a"]
    transport._partitions["a"].full = False  # type: ignore[misc]
    transport._resume("a")  # (as PartitionWork does once a batch ends)
    assert consumer.resumes == ["a"] and consumer.paused() == set()


async def test_with_every_partition_just_full_a_freed_slot_ends_the_wait_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport_module, "FULL_PAUSE_S", 30.0)  # only the slot can end it
    a = Slots(full=True)
    transport, consumer = polling(a=a, b=Slots(full=True))
    waiting = asyncio.ensure_future(transport._open_partitions())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    a.full = False
    transport._resume("a")  # (as PartitionWork does once a batch ends)
    async with asyncio.timeout(5):
        assert await waiting is None  # look again: "a" may take a batch
    assert consumer.pauses == [] and consumer.resumes == ["a"]


async def test_with_every_partition_full_the_consumer_still_polls() -> None:
    """Long handlers on every partition: within FULL_PAUSE_S they are paused and polled (a poll
    keeps the consumer in its group)."""
    began = time.monotonic()
    transport, consumer = polling(
        a=Slots(full=True, full_since=began), b=Slots(full=True, full_since=began)
    )
    for _ in range(10):  # bounded
        partitions = await transport._open_partitions()
        if partitions is not None:
            break
    assert partitions is not None
    assert sorted(partitions) == ["a", "b"] and sorted(consumer.pauses) == ["a", "b"]
    assert FULL_PAUSE_S * 0.9 <= time.monotonic() - began < 5.0


async def test_a_slot_freed_as_the_wait_times_out_leaves_its_partition_unpaused() -> None:
    """The batch that ends on the wait's last tick resumes its partition (its slot too late to
    end the wait): nothing pauses it after that, since no later batch of it may come to resume
    it (a retry topic's partition runs one batch at a time)."""
    now = time.monotonic()
    a = Slots(full=True, full_since=now)
    transport, consumer = polling(a=a, b=Slots(full=True, full_since=now))
    waiting = asyncio.ensure_future(transport._open_partitions())
    await asyncio.sleep(0.01)
    a.full = False  # freed, its slot unseen by the wait: as if it came on the timeout's tick
    assert await waiting is None
    partitions = await transport._open_partitions()
    assert partitions is not None and sorted(partitions) == ["a", "b"]
    assert consumer.pauses == ["b"]  # full all along; "a", freed, is never paused


async def test_a_partition_whose_last_full_spell_was_long_is_paused_as_soon_as_it_is_full() -> None:
    """Slow handlers: its refetch costs nothing worth saving, and its buffered records would
    hold back the other partitions' fetches for up to 100 ms each time."""
    slow = Slots(full=True, last_full_s=FULL_PAUSE_S)
    fast = Slots(full=True, last_full_s=FULL_PAUSE_S / 4)
    transport, consumer = polling(a=slow, b=fast, c=Slots())
    assert await transport._open_partitions() == ["a", "c"]
    assert consumer.pauses == ["a"]
