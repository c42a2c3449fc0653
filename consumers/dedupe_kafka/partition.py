"""The work and the offsets of one assigned Kafka partition (no broker I/O of its own).

A fetched batch runs as one `process()` call per wave: a wave never holds two records of one
record key, so messages of a key run in offset order while the others run side by side. Up to
BATCHES_IN_FLIGHT batches run at once, so a record is not left unfetched for a whole batch's
claim and completion; a batch's records of keys an earlier one holds wait for it to end. At
that many the transport leaves the partition out of its polls (what aiokafka fetched ahead
stays buffered); the partition is paused while too many messages are held. A
message the core defers for at least the smallest delay bucket (5 s) goes to its retry topic
(dedupe_kafka.retries) and is done here once the broker has the copy; one deferred for less, or
requeued, is held, with the later messages of its key queued behind it, and runs again when
due, beside the stream; so is one whose deferral, dead letter or reply the broker refused, or
whose settling failed. A partition of a retry topic runs its records as messages of their
channel, one fetched batch at a time, each record once it is due (the partition is not polled
while the batch waits). The commit position is the first offset without a final
outcome, so an offset is never committed past an unfinished message. A revoked partition starts
no next wave, and its deliveries say they are withdrawn (the core gives back the claims whose
handlers have not started): what it has not run is left, uncommitted, to the next owner.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from dedupe.claims.keys import MESSAGE_ID_HEADER
from dedupe.message import Headers, Message
from dedupe.transport import Action, Process, Settlement
from dedupe_kafka.retries import (
    deferrals_of,
    due_at,
    goes_to_retry_topic,
    origin_of,
    still_waiting,
)

logger = logging.getLogger(__name__)

# aiokafka's ConsumerRecord and TopicPartition (duck-typed, so this module needs no broker).
ConsumerRecord = Any
TopicPartition = Any

# Delay before a batch that failed inside the core (a bug, not a message problem) runs again.
INTERNAL_ERROR_DELAY_S = 5.0
# Delay before a message whose dead letter or reply the broker refused runs again (doubling
# per attempt).
DEAD_LETTER_RETRY_S = 5.0
DEAD_LETTER_RETRY_MAX_S = 300.0
# Fetched batches of one partition in flight at once (the partition is not polled at this many).
BATCHES_IN_FLIGHT = 2


def to_message(
    record: ConsumerRecord,
    *,
    attempt: int = 1,
    redelivered: bool = True,
    origin: tuple[str, int, int] | None = None,
) -> Message:
    """The envelope the core sees for a Kafka record. `redelivered`: it may have been read
    before (a partition's first batch after it was assigned, or a held retry); the core runs
    only the others in one transaction (one_transaction=True). `origin`: (topic, partition,
    offset) of the original of a retry topic's copy, which runs as a message of that topic
    (`meta["retry"]` says where the copy itself is)."""
    headers = Headers(dict(record.headers or ()))
    topic, partition, offset = origin or (record.topic, record.partition, record.offset)
    meta = {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": record.key,
        "timestamp_ms": record.timestamp,
        "redelivered": redelivered,
    }
    if origin is not None:
        meta["retry"] = f"{record.topic}/{record.partition}/{record.offset}"
    return Message(
        channel=topic,
        body=record.value if record.value is not None else b"",
        headers=headers,
        message_id=headers.get(MESSAGE_ID_HEADER) or None,
        attempt=attempt,
        content_type=headers.get("content-type"),
        meta=meta,
    )


class KafkaDelivery:
    """One record handed to the core; settling it records its outcome in its partition."""

    __slots__ = ("_message", "attempt", "due", "partition", "record", "settled")

    def __init__(self, partition: PartitionWork, record: ConsumerRecord, attempt: int = 1) -> None:
        self.partition = partition
        self.record = record
        self.attempt = attempt
        self.due = 0.0  # loop time at which a held delivery may run again
        self.settled = False
        self._message: Message | None = None

    @property
    def message(self) -> Message:
        if self._message is None:
            partition = self.partition
            if partition.retry is not None:  # a copy from a retry topic: always read before
                self._message = to_message(
                    self.record, attempt=self.attempt, origin=origin_of(self.record)
                )
            else:
                replayed_to = partition.replayed_to
                self._message = to_message(
                    self.record,
                    attempt=self.attempt,
                    redelivered=self.attempt > 1
                    or replayed_to is None
                    or self.offset < replayed_to,
                )
        return self._message

    @property
    def offset(self) -> int:
        return int(self.record.offset)

    @property
    def withdrawn(self) -> bool:
        """Its partition was revoked (or the worker stops): a claim of it whose handler has not
        started is given back and requeued, i.e. left uncommitted for the next owner
        (dedupe.transport.Delivery)."""
        return self.partition.closing

    async def settle(self, settlement: Settlement) -> bool:
        self.settled = True
        try:
            return await self.partition.settle(self, settlement)
        except Exception:
            # Kafka never delivers one record again by itself: unless the partition holds it,
            # its offset would have no outcome and no retry, and commits would stop there.
            logger.exception(
                "could not settle %s offset %d; it runs again later",
                self.partition.tp,
                self.offset,
                extra={"message_id": self.message.message_id, "outcome": str(settlement.action)},
            )
            self.partition.unsettled(self)
            return False


def _chain_key(record: ConsumerRecord) -> object:
    # Records without a key have no order to keep: each is its own chain.
    return record.key if record.key is not None else ("offset", record.offset)


def _waves(records: Sequence[ConsumerRecord]) -> list[list[ConsumerRecord]]:
    """Split records so that no wave holds two records of one key; order kept within a key."""
    waves: list[list[ConsumerRecord]] = []
    seen: collections.Counter[object] = collections.Counter()
    for record in records:
        key = _chain_key(record)
        index = seen[key]
        seen[key] += 1
        if index == len(waves):
            waves.append([])
        waves[index].append(record)
    return waves


# -- one assigned partition -----------------------------------------------------------------


class PartitionWork:
    """The work and the offsets of one assigned partition, for one assignment.

    `pending` maps every fetched offset without a final outcome to whether it has one now; the
    commit position is the first offset still without one (offsets only move forward). Every
    pending offset is in flight, held, or (once closing) left to the next owner.

    `dead_letter(record, settlement, closing)` writes the record to the dead-letter topic and
    returns True once the broker has it; it may give up (False) once `closing()` is true.
    `reply(record, result, closing)` answers a request with its stored result (True at once
    when the record asks for no reply); False holds the record like a refused dead letter.
    `defer(record, message, settlement)` copies a deferred record to its retry topic and returns
    True once the broker has it (None: every deferral is held in memory).
    `retry`: (channel, bucket bound in seconds) when this is a partition of a retry topic.
    """

    def __init__(
        self,
        tp: TopicPartition,
        process: Process,
        *,
        batch_max: int,
        max_held: int,
        dead_letter: Callable[[ConsumerRecord, Settlement, Callable[[], bool]], Awaitable[bool]],
        pause: Callable[[TopicPartition], None],
        resume: Callable[[TopicPartition], None],
        reply: Callable[[ConsumerRecord, Settlement, Callable[[], bool]], Awaitable[bool]]
        | None = None,
        batches_in_flight: int = BATCHES_IN_FLIGHT,
        defer: Callable[[ConsumerRecord, Message, Settlement], Awaitable[bool]] | None = None,
        retry: tuple[str, float] | None = None,
        carry_on: Callable[[ConsumerRecord, float], Awaitable[bool]] | None = None,
    ) -> None:
        self.tp = tp
        self.retry = retry
        # What process() is told: the topic, or the channel of a retry topic's copies.
        self.channel: str = retry[0] if retry is not None else tp.topic
        self._defer = defer
        self._carry_on = carry_on
        self._process = process
        self._batch_max = batch_max
        self._max_held = max_held
        self._dead_letter = dead_letter
        self._reply = reply
        self._pause = pause
        self._resume = resume
        self.pending: dict[int, bool] = {}
        self.fetched_to: int | None = None
        self.committed: int | None = None
        self.replayed_to: int | None = None  # offsets before it came in the first batch
        self.held: dict[object, collections.deque[KafkaDelivery]] = {}
        self.closing = False  # revoked or stopping: start nothing new (deliveries withdrawn)
        # A retry topic's partition runs one batch at a time: not polled while it waits to be due.
        self._depth = 1 if retry is not None else max(1, batches_in_flight)
        self._waiting = False  # its batch waits for a record to be due
        self.full_since = 0.0  # (time.monotonic) when it last became `full`
        self.last_full_s = 0.0  # how long its last `full` spell lasted
        self._closed = asyncio.Event()
        # The fetched batches in flight, each with the chain keys of its records.
        self._batches: dict[asyncio.Task[None], frozenset[object]] = {}
        self._retrier: asyncio.Task[None] | None = None
        self._retrying = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- positions ------------------------------------------------------------------------

    def position(self) -> int | None:
        """The offset to commit: nothing before it lacks a final outcome."""
        for offset in self.pending:
            return offset
        return self.fetched_to

    def _done(self, offset: int) -> None:
        if offset in self.pending:
            self.pending[offset] = True
        while self.pending:
            first = next(iter(self.pending))
            if not self.pending[first]:
                break
            del self.pending[first]

    @property
    def held_count(self) -> int:
        return sum(len(chain) for chain in self.held.values())

    @property
    def busy(self) -> bool:
        """A fetched batch is running (not one only waiting for its records to be due)."""
        return bool(self._batches) and not self._waiting

    @property
    def full(self) -> bool:
        """As many fetched batches are running as may: take no other (the partition is not
        polled)."""
        return len(self._batches) >= self._depth

    # -- fetched batches ------------------------------------------------------------------

    def feed(self, records: Sequence[ConsumerRecord]) -> None:
        """Take a fetched batch (never while `full`: the transport does not poll the partition
        then); the partition is paused while too many messages are held."""
        assert not self.full, "a partition runs at most batches_in_flight fetched batches"
        if self.committed is None:
            self.committed = records[0].offset  # where the group stood when we got it
            # The first batch after the assignment may have been read by the partition's
            # last owner: its records count as redelivered (dedupe.pipeline.one_transaction).
            self.replayed_to = records[-1].offset + 1
        for record in records:
            self.pending[record.offset] = False
        self.fetched_to = records[-1].offset + 1
        earlier = dict(self._batches)
        if self.held_count >= self._max_held:
            self._pause(self.tp)
        self._idle.clear()
        task = asyncio.create_task(
            self._run_batch(records, earlier),
            name=f"kafka-batch-{self.tp.topic}-{self.tp.partition}",
        )
        if not task.done():  # (an eager task factory may have run it to its end already)
            self._batches[task] = frozenset(_chain_key(record) for record in records)
            if self.full:
                self.full_since = time.monotonic()

    async def _run_batch(
        self,
        records: Sequence[ConsumerRecord],
        earlier: dict[asyncio.Task[None], frozenset[object]],
    ) -> None:
        """Run a fetched batch: its records of keys that the `earlier` batches (still in flight
        when it was fetched) hold run once those batches have ended, the others at once."""
        task = asyncio.current_task()
        try:
            if self.retry is not None:
                await self._run_when_due(records)  # (one batch at a time: none earlier)
                return
            taken = frozenset[object]().union(*earlier.values())
            now = [r for r in records if _chain_key(r) not in taken]
            later = [r for r in records if _chain_key(r) in taken]
            await asyncio.gather(self._run_records(now), self._run_records(later, after=earlier))
        finally:
            was_full = self.full
            if task is not None:
                self._batches.pop(task, None)
            if was_full and not self.full:
                self.last_full_s = time.monotonic() - self.full_since
            self._after_work()

    async def _run_records(
        self, records: Sequence[ConsumerRecord], *, after: Iterable[asyncio.Task[None]] = ()
    ) -> None:
        if records and (after := list(after)):
            await asyncio.wait(after)
        for start in range(0, len(records), self._batch_max):
            for wave in _waves(records[start : start + self._batch_max]):
                if self.closing:
                    # Revoked or stopping: the next owner may be running these already.
                    # What is left stays uncommitted (the commit stops at its first offset)
                    # and is read again there, where the claims make done ones duplicates.
                    return
                ready: list[KafkaDelivery] = []
                for record in wave:
                    delivery = self._delivery(record)
                    chain = self.held.get(_chain_key(record))
                    if chain is not None:
                        chain.append(delivery)  # runs after the held message of its key
                    else:
                        ready.append(delivery)
                if ready:
                    await self._run(ready)

    async def _run_when_due(self, records: Sequence[ConsumerRecord]) -> None:
        """Run a retry topic's batch in offset order, each record once it is due: the due ones
        at the front together, then wait for the next (at most its bucket's bound)."""
        assert self.retry is not None
        bound = self.retry[1]
        start = 0
        while start < len(records) and not self.closing:
            now = time.time()
            end = start
            while end < len(records) and due_at(records[end], bound) <= now:
                end += 1
            if end > start:
                await self._run_records(await self._not_carried_on(records[start:end], now))
                start = end
                continue
            self._waiting = True
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(due_at(records[start], bound) - now):
                        await self._closed.wait()  # revoked or stopping: leave the rest
            finally:
                self._waiting = False

    async def _not_carried_on(
        self, records: Sequence[ConsumerRecord], now: float
    ) -> list[ConsumerRecord]:
        """The records to run now: those that their bucket's bound made due but whose due
        time is later (a deferral longer than the bucket) are copied on and done here."""
        runnable: list[ConsumerRecord] = []
        carry_on = self._carry_on
        for record in records:
            wait_s = still_waiting(record, now) if carry_on and not self.closing else 0.0
            if wait_s and carry_on is not None:
                if await carry_on(record, wait_s):
                    self._done(record.offset)
                    continue
                # A copy the broker would not take: the rest of the batch runs rather than
                # wait a send timeout each (at its bucket's bound, as before).
                carry_on = None
            runnable.append(record)
        return runnable

    def _delivery(self, record: ConsumerRecord) -> KafkaDelivery:
        # A retry topic's copy: its attempt is one more than the deferred one's.
        attempt = deferrals_of(record) + 1 if self.retry is not None else 1
        return KafkaDelivery(self, record, attempt=attempt)

    async def _run(self, deliveries: Sequence[KafkaDelivery]) -> None:
        try:
            await self._process(self.channel, deliveries)
        except Exception:
            logger.exception("processing a batch from %s failed; it runs again later", self.tp)
            for delivery in deliveries:
                if not delivery.settled:
                    self._hold(delivery, INTERNAL_ERROR_DELAY_S)

    # -- outcomes -------------------------------------------------------------------------

    async def settle(self, delivery: KafkaDelivery, settlement: Settlement) -> bool:
        """True when the outcome is final here (acked, or dead letter confirmed)."""
        if settlement.action is Action.DEAD_LETTER:
            # Done only once the dead letter is on the broker; otherwise the offset stays and
            # the message runs again later (its failed claim sends the dead letter again).
            if not await self._dead_letter(delivery.record, settlement, self._is_closing):
                self._hold_with_backoff(delivery)
                return False
        elif settlement.action is not Action.ACK:
            if (
                not self.closing
                and self._defer is not None
                and goes_to_retry_topic(settlement)
                and await self._defer(delivery.record, delivery.message, settlement)
            ):
                # Its copy waits in the retry topic: this offset is done, the partition
                # commits past it and the later messages of its key run before the copy.
                self._final(delivery)
                return True
            if self.closing:
                # Stopping or revoked: not committed past, so the next owner reads it again.
                logger.debug("%s offset %d left to the next owner", self.tp, delivery.offset)
            else:
                self._hold(delivery, settlement.delay_s)
            return False
        # A request's reply (its stored result, or a fault reply: dead-lettered, or a duplicate
        # of a key that failed for good) goes out before its offset is done: one the broker
        # did not take holds the record, whose next run answers it again from the store.
        if self._reply is not None and not await self._reply(
            delivery.record, settlement, self._is_closing
        ):
            self._hold_with_backoff(delivery)
            return False
        self._final(delivery)
        return True

    def unsettled(self, delivery: KafkaDelivery) -> None:
        """Settling failed: hold the message to run again, unless its outcome is final."""
        if self.pending.get(delivery.offset, True) or self.closing:
            return  # done already, or left to the next owner (not committed past)
        self._hold(delivery, INTERNAL_ERROR_DELAY_S)

    def _is_closing(self) -> bool:
        return self.closing

    def _hold_with_backoff(self, delivery: KafkaDelivery) -> None:
        """Hold a message the broker refused to finish, doubling the wait per attempt."""
        if not self.closing:
            exponent = min(delivery.attempt - 1, 10)
            self._hold(delivery, min(DEAD_LETTER_RETRY_S * 2**exponent, DEAD_LETTER_RETRY_MAX_S))

    def _final(self, delivery: KafkaDelivery) -> None:
        chain = self.held.get(_chain_key(delivery.record))
        if chain and chain[0] is delivery:
            chain.popleft()
            if chain:
                chain[0].due = 0.0  # the next message of this key may run now
                self._wake.set()
            else:
                del self.held[_chain_key(delivery.record)]
        self._done(delivery.offset)

    def _hold(self, delivery: KafkaDelivery, delay_s: float) -> None:
        """Keep a message to run again after delay_s; later messages of its key wait behind."""
        again = KafkaDelivery(self, delivery.record, attempt=delivery.attempt + 1)
        again.due = asyncio.get_running_loop().time() + max(delay_s, 0.05)
        key = _chain_key(delivery.record)
        chain = self.held.get(key)
        if chain and chain[0] is delivery:
            chain[0] = again
        elif chain:
            # Not reachable through the batch path (it holds keys back); keep offset order.
            items = sorted([*chain, again], key=lambda d: d.offset)
            chain.clear()
            chain.extend(items)
        else:
            self.held[key] = collections.deque([again])
            if self.held_count >= self._max_held and not self.closing:
                # Resumed once fewer are held (_after_work). Never once closing: the partition
                # may be another PartitionWork's by now (revoked, then assigned here again).
                self._pause(self.tp)
        if self._retrier is None or self._retrier.done():
            self._retrier = asyncio.create_task(
                self._retry_loop(), name=f"kafka-retry-{self.tp.topic}-{self.tp.partition}"
            )
        self._wake.set()

    async def _retry_loop(self) -> None:
        """Run held messages when due, all due ones in one process() call."""
        loop = asyncio.get_running_loop()
        while self.held and not self.closing:
            now = loop.time()
            heads = [chain[0] for chain in self.held.values()]
            ready = [head for head in heads if head.due <= now]
            if not ready:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(head.due for head in heads) - now):
                        await self._wake.wait()
                continue
            self._retrying = True
            self._idle.clear()
            try:
                await self._run(ready)
            finally:
                self._retrying = False
                self._after_work()

    def _after_work(self) -> None:
        if not self._retrying and not self.full:
            if not self._batches:
                self._idle.set()
            if not self.closing and self.held_count < self._max_held:
                self._resume(self.tp)

    # -- endings --------------------------------------------------------------------------

    def close(self) -> None:
        """Start nothing new: no next wave, no retry (held messages stay uncommitted)."""
        self.closing = True
        if self._retrier is not None and not self._retrying:
            self._retrier.cancel()
        self._wake.set()
        self._closed.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()
