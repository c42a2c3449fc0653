"""The work and offsets of one Kafka partition, without a broker: waves, holds, commit position."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from dedupe.claims.records import Reason
from dedupe.pipeline.outcomes import REQUEUE_WITHDRAWN
from dedupe.transport import ACK, Action, Delivery, Settlement, withdrawn
from dedupe_kafka.partition import KafkaDelivery, PartitionWork, to_message


@dataclass(frozen=True)
class TP:
    topic: str = "orders"
    partition: int = 0


@dataclass(frozen=True)
class Record:
    offset: int
    key: bytes | None = None
    value: bytes | None = b"{}"
    headers: tuple[tuple[str, bytes], ...] = ()
    topic: str = "orders"
    partition: int = 0
    timestamp: int = 0


def records(*keys: str | None, start: int = 0) -> list[Record]:
    return [
        Record(start + i, key.encode() if key is not None else None) for i, key in enumerate(keys)
    ]


Decide = Callable[[KafkaDelivery], Settlement]


@dataclass
class Harness:
    """A PartitionWork whose core is a function deciding each delivery's settlement."""

    decide: Decide = lambda _delivery: ACK
    batch_max: int = 64
    max_held: int = 1000
    batches_in_flight: int = 2
    dead_letters_written: bool = True
    calls: list[list[tuple[int, int]]] = field(default_factory=list)  # [(offset, attempt)]
    paused: int = 0
    resumed: int = 0
    dead: list[int] = field(default_factory=list)
    work: PartitionWork = field(init=False)

    def __post_init__(self) -> None:
        self.work = PartitionWork(
            TP(),
            self.process,
            batch_max=self.batch_max,
            max_held=self.max_held,
            dead_letter=self.dead_letter,
            pause=self.pause,
            resume=self.resume,
            batches_in_flight=self.batches_in_flight,
        )

    async def process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        assert channel == "orders"
        batch = [d for d in deliveries if isinstance(d, KafkaDelivery)]
        self.calls.append([(d.offset, d.message.attempt) for d in batch])
        await asyncio.sleep(0)
        for delivery in batch:
            await delivery.settle(self.decide(delivery))

    async def dead_letter(
        self, record: Record, settlement: Settlement, closing: Callable[[], bool]
    ) -> bool:
        self.dead.append(record.offset)
        return self.dead_letters_written

    def pause(self, tp: TP) -> None:
        self.paused += 1

    def resume(self, tp: TP) -> None:
        self.resumed += 1

    async def run(self, batch: list[Record]) -> None:
        self.work.feed(batch)
        await self.idle()

    async def idle(self) -> None:
        async with asyncio.timeout(5):
            await self.work.wait_idle()


def defer_first_attempt(*offsets: int, delay_s: float = 0.05) -> Decide:
    def decide(delivery: KafkaDelivery) -> Settlement:
        if delivery.offset in offsets and delivery.attempt == 1:
            return Settlement(Action.DEFER, delay_s=delay_s)
        return ACK

    return decide


async def test_a_fetched_batch_of_distinct_keys_is_one_process_call() -> None:
    """One call (one claim statement) for the batch; the commit position moves past it."""
    h = Harness()
    await h.run(records("a", "b", None, None, "c"))
    assert h.calls == [[(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]]
    assert h.work.position() == 5
    assert h.paused == 0  # one batch in flight: the partition keeps being fetched


async def test_records_sharing_a_key_run_one_after_another_in_offset_order() -> None:
    """A key's second record runs in a later wave than its first; other keys are not split."""
    h = Harness()
    await h.run(records("a", "b", "a", "c", "a"))
    assert h.calls == [[(0, 1), (1, 1), (3, 1)], [(2, 1)], [(4, 1)]]
    assert h.work.position() == 5


async def test_batches_larger_than_batch_max_are_split() -> None:
    h = Harness(batch_max=2)
    await h.run(records(None, None, None, None, None))
    assert [len(call) for call in h.calls] == [2, 2, 1]


class Gated(Harness):
    """A harness whose core waits at the offsets in `gates` until each gate is opened."""

    def __init__(self, *gated: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gates = {offset: asyncio.Event() for offset in gated}
        self.started: list[int] = []

    async def process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        batch = [d for d in deliveries if isinstance(d, KafkaDelivery)]
        self.started.extend(d.offset for d in batch)
        for delivery in batch:
            gate = self.gates.get(delivery.offset)
            if gate is not None:
                await gate.wait()
        await super().process(channel, deliveries)


async def test_a_second_batch_runs_beside_the_first_except_for_the_keys_the_first_holds() -> None:
    """Fetched while the first batch still runs, the next one starts its records of other keys
    at once; its record of a key the first batch holds waits until that batch has ended, so a
    key's records still run in offset order. The commit position never passes the first's."""
    h = Gated(0)
    h.work.feed(records("a", "b"))  # offset 0 ("a") waits at its gate
    await asyncio.sleep(0.01)
    assert h.paused == 0
    h.work.feed(records("a", "c", start=2))  # "a" again (offset 2), and "c"
    assert h.work.full  # two batches in flight: no third is polled for
    assert h.paused == 0  # left out of the polls, not paused (a pause drops fetched records)
    await asyncio.sleep(0.05)
    assert 3 in h.started and 2 not in h.started  # "c" ran, the second "a" waits
    assert h.work.position() == 0  # offset 3 is done, 0 is not
    h.gates[0].set()
    await h.idle()
    assert h.started.index(0) < h.started.index(2)
    assert h.work.position() == 4
    assert h.resumed >= 1
    assert [offset for call in h.calls for offset, _ in call] == [3, 0, 1, 2]


async def test_deeper_partitions_keep_a_keys_records_in_offset_order_over_several_batches() -> None:
    """With four batches in flight, the third and fourth are fetched while the first two run;
    a key present in all of them still runs in offset order, other keys at once, and the
    partition is full (not polled) only at the fourth."""
    h = Gated(0, batches_in_flight=4)
    h.work.feed(records("a", "b"))  # offset 0 ("a") waits at its gate
    h.work.feed(records("a", "c", start=2))
    h.work.feed(records("a", "d", start=4))
    assert h.paused == 0 and not h.work.full
    h.work.feed(records("e", start=6))
    assert h.work.full and h.paused == 0
    await asyncio.sleep(0.05)
    assert {3, 5, 6} <= set(h.started) and not {2, 4} & set(h.started)
    h.gates[0].set()
    await h.idle()
    assert h.started.index(0) < h.started.index(2) < h.started.index(4)
    assert h.work.position() == 7


async def test_a_partition_closed_while_a_batch_waits_for_an_earlier_one_starts_none_of_it() -> (
    None
):
    """Revoked while the second batch's shared keys wait: they are left to the next owner."""
    h = Gated(0)
    h.work.feed(records("a"))
    await asyncio.sleep(0.01)
    h.work.feed(records("a", start=1))
    await asyncio.sleep(0.01)
    h.work.close()
    h.gates[0].set()
    await h.idle()
    assert 1 not in h.started
    assert h.work.position() == 1  # offset 0 ran and is done; 1 is left uncommitted


async def test_a_closed_partition_never_pauses_its_topic_partition_again() -> None:
    """A revoked partition's late batch fails inside the core and holds its record up to
    max_held: it must not pause the topic partition, which a new PartitionWork may own by now
    (revoked, then assigned to this worker again), and which nothing would resume."""
    h = Harness(max_held=1)
    gate = asyncio.Event()

    async def process(channel: str, deliveries: Sequence[Delivery]) -> None:
        await gate.wait()
        raise RuntimeError("bug")

    h.work._process = process
    h.work.feed(records("a"))
    await asyncio.sleep(0.01)
    h.work.close()
    paused = h.paused
    gate.set()
    await h.idle()
    assert h.paused == paused


async def test_the_commit_position_stops_at_a_deferred_message_until_it_is_settled() -> None:
    """Later offsets complete, but nothing is committed past the one still waiting."""
    h = Harness(decide=defer_first_attempt(1, delay_s=0.3))
    await h.run(records("a", "b", "c", "d"))
    assert h.work.position() == 1
    assert h.work.pending == {1: False, 2: True, 3: True}
    await asyncio.sleep(0.5)
    await h.idle()
    assert h.calls[-1] == [(1, 2)]  # ran again, as attempt 2
    assert h.work.position() == 4
    assert not h.work.held


async def test_a_deferred_message_holds_back_only_the_later_messages_of_its_key() -> None:
    """Other keys flow on; the same key's next message waits, then runs after it, in order."""
    h = Harness(decide=defer_first_attempt(0, delay_s=0.2))
    await h.run(records("a", "b"))
    await h.run(records("a", "c", start=2))  # "a" is still held: offset 2 must wait
    assert [o for call in h.calls for o, _ in call] == [0, 1, 3]
    assert h.work.held_count == 2
    await asyncio.sleep(0.4)
    await h.idle()
    ran = [(o, a) for call in h.calls for o, a in call]
    assert ran == [(0, 1), (1, 1), (3, 1), (0, 2), (2, 1)]
    assert h.work.position() == 4


async def test_due_held_messages_of_several_keys_run_as_one_batch() -> None:
    h = Harness(decide=defer_first_attempt(0, 1, 2, delay_s=0.1))
    await h.run(records("a", "b", "c"))
    await asyncio.sleep(0.3)
    await h.idle()
    assert h.calls[-1] == [(0, 2), (1, 2), (2, 2)]


def dead_letter_first(delivery: KafkaDelivery) -> Settlement:
    if delivery.offset == 0:
        return Settlement(Action.DEAD_LETTER, reason=Reason.INVALID_PAYLOAD, detail="x")
    return ACK


async def test_a_dead_letter_counts_as_done_only_once_the_broker_has_it() -> None:
    written = Harness(decide=dead_letter_first)
    await written.run(records("a", "b"))
    assert (written.dead, written.work.position()) == ([0], 2)


async def test_a_dead_letter_the_broker_refused_is_held_and_tried_again_with_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never committed past without a dead letter, never dropped: it runs again, later."""
    monkeypatch.setattr("dedupe_kafka.partition.DEAD_LETTER_RETRY_S", 0.2)
    h = Harness(decide=dead_letter_first, dead_letters_written=False)
    await h.run(records("a", "b"))
    assert (h.dead, h.work.position()) == ([0], 0)
    assert h.work.held_count == 1  # held for a retry, not orphaned
    await asyncio.sleep(0.35)
    await h.idle()
    assert h.dead == [0, 0]  # tried again after 0.2 s ...
    assert h.work.position() == 0
    h.dead_letters_written = True
    await asyncio.sleep(0.5)  # ... and then after 0.4 s (doubling), when it went through
    await h.idle()
    assert h.dead == [0, 0, 0]
    assert h.calls[-1] == [(0, 3)]
    assert (h.work.position(), h.work.held_count) == (2, 0)


def answered(delivery: KafkaDelivery) -> Settlement:
    return Settlement(Action.ACK, result='{"fee": 1}')


async def test_a_reply_the_broker_refused_holds_the_request_and_tries_again_with_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An acked request whose reply did not reach the broker is not done: its offset stays,
    it runs again later (a duplicate, answered from the stored result) until the reply is
    written; the records after it are done meanwhile."""
    monkeypatch.setattr("dedupe_kafka.partition.DEAD_LETTER_RETRY_S", 0.2)
    h = Harness(decide=answered)
    sent: list[tuple[int, str]] = []
    written = [False]

    async def reply(record: Record, settlement: Settlement, closing: Callable[[], bool]) -> bool:
        assert settlement.result is not None
        sent.append((record.offset, settlement.result))
        return written[0] or record.offset != 0

    h.work._reply = reply
    await h.run(records("a", "b"))
    assert sent == [(0, '{"fee": 1}'), (1, '{"fee": 1}')]
    assert (h.work.position(), h.work.held_count) == (0, 1)
    await asyncio.sleep(0.35)
    await h.idle()
    assert [offset for offset, _ in sent] == [0, 1, 0]  # tried again after 0.2 s
    written[0] = True
    await asyncio.sleep(0.5)  # then after 0.4 s (doubling): through
    await h.idle()
    assert [offset for offset, _ in sent] == [0, 1, 0, 0]
    assert (h.work.position(), h.work.held_count) == (2, 0)


async def test_a_settle_that_raises_holds_the_message_to_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The offset neither stays orphaned (commits frozen) nor is committed past."""
    monkeypatch.setattr("dedupe_kafka.partition.INTERNAL_ERROR_DELAY_S", 0.05)
    h = Harness(decide=dead_letter_first)
    failures = [RuntimeError("producer bug")]

    async def dead_letter(
        record: Record, settlement: Settlement, closing: Callable[[], bool]
    ) -> bool:
        h.dead.append(record.offset)
        if failures:
            raise failures.pop()
        return True

    h.work._dead_letter = dead_letter
    await h.run(records("a", "b"))
    assert h.work.position() == 0
    assert h.work.held_count == 1
    await asyncio.sleep(0.15)
    await h.idle()
    assert h.dead == [0, 0]
    assert [call for call in h.calls if call[0][0] == 0] == [[(0, 1), (1, 1)], [(0, 2)]]
    assert (h.work.position(), h.work.held_count) == (2, 0)


async def test_a_settle_that_raises_on_a_closing_partition_leaves_the_offset_uncommitted() -> None:
    h = Harness(decide=dead_letter_first)

    async def dead_letter(
        record: Record, settlement: Settlement, closing: Callable[[], bool]
    ) -> bool:
        h.work.close()
        raise RuntimeError("producer bug")

    h.work._dead_letter = dead_letter
    await h.run(records("a", "b"))
    assert (h.work.position(), h.work.held_count) == (0, 0)


async def test_a_closing_partition_starts_nothing_new_and_keeps_requeued_offsets() -> None:
    """On revocation or shutdown: no next wave, no retries, nothing committed past a requeue."""
    h = Harness(decide=lambda d: Settlement(Action.REQUEUE, detail="stopping"))
    h.work.close()
    await h.run(records("a", "a"))
    assert h.calls == []
    assert h.work.position() == 0

    late = Harness(decide=lambda d: Settlement(Action.REQUEUE, detail="stopping"))
    late.work.feed(records("a", "b"))
    late.work.close()
    await late.idle()
    assert late.work.position() == 0
    assert not late.work.held
    assert late.resumed == 0


async def test_a_revoked_partition_starts_no_next_wave_and_commits_only_before_it() -> None:
    """The next owner may run them already: the rest of the batch is left uncommitted."""
    h = Harness(batch_max=3)

    def close_after_first_call(delivery: KafkaDelivery) -> Settlement:
        h.work.close()
        return ACK

    h.decide = close_after_first_call
    await h.run(records("a", "a", "b", "c"))
    assert h.calls == [[(0, 1), (2, 1)]]  # neither the chunk's second wave nor offset 3
    assert h.work.position() == 1  # offset 2 is done, but 1 never ran


async def test_a_revoked_partitions_deliveries_are_withdrawn_the_given_back_stay_uncommitted() -> (
    None
):
    """What the core asks before a claimed run starts (dedupe.transport.withdrawn): once the
    partition is revoked its deliveries are withdrawn; the ones given back (requeued) hold the
    commit position, runs under way that finish after the revoke still count."""
    h = Harness()
    asked: list[bool] = []

    def decide(delivery: KafkaDelivery) -> Settlement:
        asked.append(withdrawn(delivery))
        if delivery.offset == 0:
            h.work.close()  # revoked while offset 0 runs
        return REQUEUE_WITHDRAWN if delivery.offset == 1 else ACK

    h.decide = decide
    await h.run(records("a", "b", "c"))
    assert asked == [False, True, True]
    assert h.work.position() == 1  # 0 done, 1 given back (read again by the next owner)
    assert not h.work.held


async def test_too_many_held_messages_keep_the_partition_paused() -> None:
    h = Harness(decide=defer_first_attempt(0, 1, delay_s=0.2), max_held=2)
    await h.run(records("a", "b"))
    assert h.resumed == 0  # two held: no more fetching until they drain
    await asyncio.sleep(0.4)
    await h.idle()
    assert h.resumed >= 1
    assert h.work.position() == 2


async def test_a_failure_inside_the_core_holds_the_unsettled_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("dedupe_kafka.partition.INTERNAL_ERROR_DELAY_S", 0.05)
    h = Harness()
    broken = [True]

    async def process(channel: str, deliveries: Sequence[Delivery]) -> None:
        if broken[0]:
            broken[0] = False
            raise RuntimeError("bug")
        await Harness.process(h, channel, deliveries)

    h.work._process = process
    await h.run(records("a"))
    await asyncio.sleep(0.2)
    await h.idle()
    assert h.calls == [[(0, 2)]]
    assert h.work.position() == 1


def test_a_record_becomes_a_message_with_its_id_header_and_coordinates() -> None:
    record = Record(
        7, b"k", b'{"n": 1}', headers=(("message-id", b"m-1"), ("Content-Type", b"app/json"))
    )
    message = to_message(record, attempt=3)
    assert message.message_id == "m-1"
    assert message.attempt == 3
    assert message.content_type == "app/json"
    assert message.body == b'{"n": 1}'
    assert dict(message.meta) == {
        "topic": "orders",
        "partition": 0,
        "offset": 7,
        "key": b"k",
        "timestamp_ms": 0,
        "redelivered": True,
    }
    assert to_message(Record(8, value=None)).body == b""
    assert to_message(record, redelivered=False).meta["redelivered"] is False


async def test_the_first_batch_after_an_assignment_and_held_retries_count_as_redelivered() -> None:
    """The partition's last owner may have read its first fetched batch: those records (and a
    record held to run again) are redelivered; the batches after it are first deliveries."""
    seen: list[tuple[int, int, bool]] = []

    def decide(delivery: KafkaDelivery) -> Settlement:
        seen.append((delivery.offset, delivery.attempt, delivery.message.meta["redelivered"]))
        return defer_first_attempt(3)(delivery)

    h = Harness(decide=decide)
    await h.run(records("a", "b"))
    await h.run(records("c", "d", start=2))
    await asyncio.sleep(0.2)  # the deferred record runs again after 0.05 s
    await h.idle()
    assert sorted(seen) == [(0, 1, True), (1, 1, True), (2, 1, False), (3, 1, False), (3, 2, True)]


async def test_a_full_spell_is_timed_from_the_batch_that_filled_it_to_the_one_that_freed_it() -> (
    None
):
    """The transport pauses a partition whose last full spell lasted FULL_PAUSE_S or more as soon
    as it is full again (slow handlers): the spell's length is what it reads."""
    h = Gated(0, 1)
    h.work.feed(records("a"))  # offsets 0 and 1 wait at their gates
    h.work.feed(records("b", start=1))
    assert h.work.full and h.work.last_full_s == 0.0
    await asyncio.sleep(0.05)
    h.gates[1].set()  # the spell ends with the first batch to end
    for _ in range(500):  # bounded: 5 s
        if not h.work.full:
            break
        await asyncio.sleep(0.01)
    spell = h.work.last_full_s
    assert spell >= 0.05
    await asyncio.sleep(0.2)
    h.gates[0].set()
    await h.idle()
    assert h.work.last_full_s == spell  # not timed to the last batch's end
