"""Kafka retry topics without a broker: the bucket a deferral goes to, what a copy carries, and
a partition that hands long deferrals to the broker and runs a retry topic's copies when due."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import KafkaError, KafkaTimeoutError

from dedupe.transport import (
    ACK,
    DEFERRALS_HEADER,
    DELAY_BUCKETS,
    Action,
    Delivery,
    Settlement,
    delay_bucket,
)
from dedupe_kafka.partition import KafkaDelivery, PartitionWork, to_message
from dedupe_kafka.retries import (
    DUE_AT_HEADER,
    ORIGIN_HEADER,
    Retries,
    due_at,
    goes_to_retry_topic,
    origin_of,
    retry_bucket,
    retry_headers,
    retry_topic,
    retry_topics,
)
from dedupe_rabbitmq import topology
from dedupe_rabbitmq import transport as rabbit_transport
from tests.unit.test_kafka_partition import TP, Record, records


def test_a_deferral_goes_to_the_smallest_bucket_that_covers_its_delay() -> None:
    assert [label for _, label in DELAY_BUCKETS] == ["5s", "30s", "2m", "10m", "1h"]
    assert retry_topic("c", 5) == "c.retry.5s"
    assert retry_topic("c", 5.01) == "c.retry.30s"
    assert retry_topic("c", 6) == "c.retry.30s"
    assert retry_topic("c", 30) == "c.retry.30s"
    assert retry_topic("c", 120) == "c.retry.2m"
    assert retry_topic("c", 600) == "c.retry.10m"
    assert retry_topic("c", 3600) == "c.retry.1h"
    assert retry_topic("c", 7200) == "c.retry.1h"  # longer than the last bound: the last
    assert delay_bucket(0.05) == (5.0, "5s")
    assert retry_topics("c") == [f"c.retry.{label}" for label in ("5s", "30s", "2m", "10m", "1h")]


def test_rabbitmq_delay_queues_use_the_same_buckets() -> None:
    """One table of buckets and one deferrals header for both brokers (dedupe.transport's)."""
    assert topology.DELAY_BUCKETS == DELAY_BUCKETS
    assert rabbit_transport.DEFERRALS_HEADER == DEFERRALS_HEADER
    for delay in (0.05, 5, 6, 30, 31, 120, 600, 3600, 7200):
        assert topology.delay_name("c", delay).rsplit(".", 1)[1] == delay_bucket(delay)[1]


def test_only_deferrals_of_at_least_the_smallest_bucket_go_through_the_broker() -> None:
    assert goes_to_retry_topic(Settlement(Action.DEFER, delay_s=5.0))
    assert goes_to_retry_topic(Settlement(Action.DEFER, delay_s=3600))
    assert not goes_to_retry_topic(Settlement(Action.DEFER, delay_s=4.99))
    assert not goes_to_retry_topic(Settlement(Action.REQUEUE, delay_s=10))  # store down: held
    assert not goes_to_retry_topic(ACK)


def test_a_retry_topic_names_its_channel_and_bucket() -> None:
    assert retry_bucket("c.retry.30s") == ("c", 30.0)
    assert retry_bucket("a.retry.b.retry.1h") == ("a.retry.b", 3600.0)
    assert retry_bucket("c.retry.7s") is None
    assert retry_bucket("c") is None
    assert retry_bucket(".retry.5s") is None


def test_a_copy_carries_its_attempt_due_time_and_origin_and_runs_as_the_original() -> None:
    original = Record(7, b"k", headers=(("message-id", b"m"), (DEFERRALS_HEADER, b"9")))
    headers = retry_headers(original, 2, 1_000_000, origin_of(original))
    assert headers == [
        ("message-id", b"m"),
        (DEFERRALS_HEADER, b"2"),
        (DUE_AT_HEADER, b"1000000"),
        (ORIGIN_HEADER, b"orders/0/7"),
    ]
    copy = Record(3, b"k", headers=tuple(headers), topic="orders.retry.30s", partition=2)
    assert origin_of(copy) == ("orders", 0, 7)
    # A copy of the copy keeps the first origin.
    assert retry_headers(copy, 3, 5, origin_of(copy))[-1] == (ORIGIN_HEADER, b"orders/0/7")
    # An origin naming another channel is not believed.
    stray = Record(3, headers=((ORIGIN_HEADER, b"payments/0/7"),), topic="orders.retry.5s")
    assert origin_of(stray) == ("orders", 0, 3)
    # A record of a channel is its own origin, whatever its headers say.
    assert origin_of(Record(4, headers=((ORIGIN_HEADER, b"x/1/1"),))) == ("orders", 0, 4)


def test_a_copy_never_waits_longer_than_its_bucket() -> None:
    written_ms = 1_000_000
    far = Record(0, headers=((DUE_AT_HEADER, b"99999999999"),), timestamp=written_ms)
    assert due_at(far, 30.0) == written_ms / 1000 + 30.0
    soon = Record(0, headers=((DUE_AT_HEADER, b"1006000"),), timestamp=written_ms)
    assert due_at(soon, 30.0) == 1006.0
    assert due_at(Record(0, headers=((DUE_AT_HEADER, b"x"),), timestamp=written_ms), 5) == 1000.0


# -- a partition with a retry topic ---------------------------------------------------------


@dataclass
class Retrying:
    """A PartitionWork (of a channel or of a retry topic) whose deferrals go to `defer`."""

    decide: Callable[[KafkaDelivery], Settlement] = lambda _delivery: ACK
    tp: TP = field(default_factory=TP)
    retry: tuple[str, float] | None = None
    accepted: bool = True  # what the broker says to a deferral's copy
    deferred: list[tuple[int, int, float]] = field(default_factory=list)  # offset, attempt, delay
    calls: list[list[tuple[int, int]]] = field(default_factory=list)
    messages: list[tuple[float, str, int, object, object]] = field(default_factory=list)
    paused: int = 0
    carry_ok: bool = True  # what the broker says to a copy carried on
    carried: list[tuple[int, float]] = field(default_factory=list)  # offset, wait left
    work: PartitionWork = field(init=False)

    def __post_init__(self) -> None:
        self.work = PartitionWork(
            self.tp,
            self.process,
            batch_max=64,
            max_held=1000,
            dead_letter=self.dead_letter,
            pause=self.pause,
            resume=lambda tp: None,
            batches_in_flight=2,
            defer=self.defer,
            retry=self.retry,
            carry_on=self.carry_on,
        )

    async def process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        assert channel == "orders"
        batch = [d for d in deliveries if isinstance(d, KafkaDelivery)]
        self.calls.append([(d.offset, d.message.attempt) for d in batch])
        for d in batch:
            m = d.message
            self.messages.append(
                (time.time(), m.channel, m.attempt, m.meta["offset"], m.meta["redelivered"])
            )
        await asyncio.sleep(0)
        for delivery in batch:
            await delivery.settle(self.decide(delivery))

    async def defer(self, record: Record, message: object, settlement: Settlement) -> bool:
        self.deferred.append((record.offset, getattr(message, "attempt", 0), settlement.delay_s))
        return self.accepted

    async def dead_letter(
        self, record: Record, settlement: Settlement, closing: Callable[[], bool]
    ) -> bool:
        return True

    async def carry_on(self, record: Record, wait_s: float) -> bool:
        self.carried.append((record.offset, wait_s))
        return self.carry_ok

    def pause(self, tp: TP) -> None:
        self.paused += 1

    async def run(self, batch: list[Record], timeout_s: float = 5) -> None:
        self.work.feed(batch)
        async with asyncio.timeout(timeout_s):
            await self.work.wait_idle()


def defer_first(offset: int, delay_s: float) -> Callable[[KafkaDelivery], Settlement]:
    def decide(delivery: KafkaDelivery) -> Settlement:
        if delivery.offset == offset and delivery.attempt == 1:
            return Settlement(Action.DEFER, delay_s=delay_s)
        return ACK

    return decide


async def test_a_long_deferral_goes_to_the_broker_and_its_offset_is_done() -> None:
    """Not held: the commit position moves past it and the later record of its key runs."""
    r = Retrying(defer_first(0, delay_s=6.0))
    await r.run(records("a", "a", "b"))
    assert r.deferred == [(0, 1, 6.0)]
    assert r.calls == [[(0, 1), (2, 1)], [(1, 1)]]
    assert r.work.held == {}
    assert r.work.position() == 3


async def test_a_deferral_the_broker_refused_is_held_in_memory() -> None:
    r = Retrying(defer_first(0, delay_s=6.0), accepted=False)
    r.work.feed(records("a", "a", "b"))
    await asyncio.sleep(0.2)
    assert r.deferred == [(0, 1, 6.0)]
    assert r.work.position() == 0  # held: never committed past
    assert [d.offset for d in r.work.held[b"a"]] == [0, 1]
    r.work.close()


async def test_a_short_deferral_is_held_in_memory_as_before() -> None:
    r = Retrying(defer_first(0, delay_s=0.1))
    await r.run(records("a", "b"))
    await asyncio.sleep(0.4)
    assert r.deferred == []
    assert r.calls == [[(0, 1), (1, 1)], [(0, 2)]]
    assert r.work.position() == 2


def copy_of(offset: int, *, due_in_s: float, deferrals: int = 1, key: bytes = b"a") -> Record:
    now = time.time()
    headers = retry_headers(
        Record(40 + offset, key),
        deferrals,
        int((now + due_in_s) * 1000),
        ("orders", 0, 40 + offset),
    )
    return Record(
        offset,
        key,
        headers=tuple(headers),
        topic="orders.retry.5s",
        timestamp=int(now * 1000),
    )


async def test_a_retry_topic_runs_its_copies_as_their_channel_when_due_unpolled_meanwhile() -> None:
    r = Retrying(tp=TP("orders.retry.5s"), retry=("orders", 5.0))
    fed = time.time()
    batch = [copy_of(0, due_in_s=-1), copy_of(1, due_in_s=0.6, deferrals=2, key=b"b")]
    r.work.feed(batch)
    assert r.work.full  # one batch at a time: the transport polls it for no more meanwhile
    assert r.paused == 0  # (what aiokafka fetched ahead stays buffered)
    await asyncio.sleep(0.3)
    assert r.calls == [[(0, 2)]]  # the due one ran; the other waits
    assert not r.work.busy  # (waiting is not running: the fetch loop need not spin)
    assert r.work.position() == 1  # the waiting copy is not committed past
    async with asyncio.timeout(5):
        await r.work.wait_idle()
    assert r.calls == [[(0, 2)], [(1, 3)]]
    ran_at = r.messages[1][0]
    assert ran_at >= fed + 0.6 - 0.01
    # Each runs as a message of its channel, its original offset and read before.
    assert [m[1:] for m in r.messages] == [("orders", 2, 40, True), ("orders", 3, 41, True)]
    assert r.work.position() == 2


async def test_a_copy_deferred_again_goes_to_the_broker_with_its_attempt() -> None:
    r = Retrying(
        lambda d: Settlement(Action.DEFER, delay_s=40) if d.attempt == 2 else ACK,
        tp=TP("orders.retry.5s"),
        retry=("orders", 5.0),
    )
    await r.run([copy_of(0, due_in_s=0)])
    assert r.deferred == [(0, 2, 40)]
    assert r.work.position() == 1


async def test_a_waiting_retry_batch_ends_at_once_when_the_partition_is_revoked() -> None:
    r = Retrying(tp=TP("orders.retry.5s"), retry=("orders", 5.0))
    r.work.feed([copy_of(0, due_in_s=4)])
    await asyncio.sleep(0.05)
    r.work.close()
    async with asyncio.timeout(1):
        await r.work.wait_idle()
    assert r.calls == []
    assert r.work.position() == 0  # left to the next owner


class Producer:
    """A stand-in for the idempotent producer: records what it is asked to write."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.sent: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []

    async def send_and_wait(
        self, topic: str, *, value: bytes | None, key: bytes | None, headers: Any
    ) -> None:
        if self.error is not None:
            raise self.error
        self.sent.append((topic, value, key, headers))


async def test_the_writer_copies_the_record_to_its_bucket_with_key_body_and_headers() -> None:
    producer = Producer()
    retries = Retries(lambda: producer)  # type: ignore[arg-type, return-value]
    record = Record(7, b"k", value=b"body", headers=(("message-id", b"m"),))
    before = time.time()
    message = to_message(record, attempt=3)
    assert await retries.send(record, message, Settlement(Action.DEFER, delay_s=6))
    [(topic, value, key, headers)] = producer.sent
    assert (topic, value, key) == ("orders.retry.30s", b"body", b"k")
    named = dict(headers)
    assert (named["message-id"], named[DEFERRALS_HEADER]) == (b"m", b"3")
    assert named[ORIGIN_HEADER] == b"orders/0/7"
    assert before + 6 - 0.001 <= int(named[DUE_AT_HEADER]) / 1000 <= time.time() + 6


@pytest.mark.parametrize("error", [KafkaTimeoutError(), KafkaError("refused"), None])
async def test_a_copy_the_broker_does_not_take_is_not_done(error: Exception | None) -> None:
    producer = None if error is None else Producer(error)  # None: the transport is closed
    retries = Retries(lambda: producer)  # type: ignore[arg-type, return-value]
    record = Record(7, b"k")
    deferral = Settlement(Action.DEFER, delay_s=6)
    assert not await retries.send(record, to_message(record), deferral)


def test_a_copy_due_after_its_buckets_bound_still_waits_and_a_far_or_near_one_does_not() -> None:
    from dedupe_kafka.retries import still_waiting

    now = 1_000_000.0

    def record(due_s: float | None) -> Any:
        headers = [] if due_s is None else [("x-dedupe-due-at", str(int(due_s * 1000)).encode())]
        return SimpleNamespace(headers=headers)

    assert still_waiting(record(now + 7200), now) == 7200  # two hours: on to the 1 h topic
    assert still_waiting(record(now + 0.5), now) == 0  # within the slack: run it now
    assert still_waiting(record(now - 10), now) == 0
    assert still_waiting(record(None), now) == 0
    assert still_waiting(record(now + 30 * 24 * 3600), now) == 0  # not a deferral we wrote
    bad = SimpleNamespace(headers=[("x-dedupe-due-at", b"soon")])
    assert still_waiting(bad, now) == 0


def long_copy(offset: int, *, due_in_s: float) -> Record:
    """A copy in .retry.5s written 6 s ago (its bucket's bound made it due) whose due time is
    `due_in_s` away."""
    return dataclasses.replace(
        copy_of(offset, due_in_s=due_in_s), timestamp=int((time.time() - 6) * 1000)
    )


@pytest.mark.parametrize("broker_takes_it", [True, False])
async def test_copies_due_later_than_their_bucket_are_carried_on_or_run_if_the_broker_refuses(
    broker_takes_it: bool,
) -> None:
    r = Retrying(tp=TP("orders.retry.5s"), retry=("orders", 5.0), carry_ok=broker_takes_it)
    await r.run([long_copy(0, due_in_s=100), long_copy(1, due_in_s=100), copy_of(2, due_in_s=-1)])
    if broker_takes_it:
        assert [offset for offset, _ in r.carried] == [0, 1]
        assert all(90 < wait <= 100 for _, wait in r.carried)
        assert r.calls == [[(2, 2)]]  # only the one really due ran
    else:
        # The first refusal ends the carrying: the batch runs, none waits a send timeout more.
        assert [offset for offset, _ in r.carried] == [0]
        assert [run for call in r.calls for run in call] == [(0, 2), (1, 2), (2, 2)]
    assert r.work.position() == 3
