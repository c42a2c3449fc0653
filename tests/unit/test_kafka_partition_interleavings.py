"""Random interleavings of fetched batches, defers, refused dead letters and retries on one
partition (two batches in flight): a key never runs beside itself and finishes in offset
order, the commit position never passes an unfinished offset, it is never resumed while full
(the transport polls it only when it is not full, as this loop feeds it), and at the end nothing
is held, in flight or left paused."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

import pytest

from dedupe.claims.records import Reason
from dedupe.transport import ACK, Action, Delivery, Settlement
from dedupe_kafka import partition as kp
from dedupe_kafka.partition import KafkaDelivery, PartitionWork
from tests.unit.test_kafka_partition import TP, Record


class Simulation:
    def __init__(self, seed: int, max_held: int) -> None:
        self.rng = random.Random(seed)
        self.paused = False
        self.running: dict[object, int] = {}  # chain key -> the offset running
        self.finished: dict[object, list[int]] = {}
        self.final: set[int] = set()
        self.errors: list[str] = []
        self.work = PartitionWork(
            TP(),
            self.process,
            batch_max=4,
            max_held=max_held,
            dead_letter=self.dead_letter,
            pause=self.pause,
            resume=self.resume,
        )

    def pause(self, tp: TP) -> None:
        self.paused = True

    def resume(self, tp: TP) -> None:
        if self.work.full:
            self.errors.append("resumed while full")
        self.paused = False

    async def dead_letter(
        self, record: Record, settlement: Settlement, closing: Callable[[], bool]
    ) -> bool:
        await asyncio.sleep(self.rng.random() * 0.002)
        return self.rng.random() < 0.7  # the broker refuses three in ten

    def check_position(self) -> None:
        position = self.work.position()
        for offset in range(self.work.committed or 0, position or 0):
            if offset not in self.final:
                self.errors.append(f"position {position} past unfinished {offset}")
                return

    async def process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        batch = [d for d in deliveries if isinstance(d, KafkaDelivery)]
        for delivery in batch:
            key = kp._chain_key(delivery.record)
            if key in self.running:
                self.errors.append(f"{key!r} runs {delivery.offset} beside {self.running[key]}")
            self.running[key] = delivery.offset
        await asyncio.sleep(self.rng.random() * 0.004)
        for delivery in batch:
            key = kp._chain_key(delivery.record)
            draw = self.rng.random()
            if draw < 0.15 and delivery.attempt < 4:
                settlement = Settlement(Action.DEFER, delay_s=0.001)
            elif draw < 0.2 and delivery.attempt < 4:
                settlement = Settlement(Action.DEAD_LETTER, reason=Reason.INVALID_PAYLOAD)
            else:
                settlement = ACK
            self.running.pop(key, None)
            if await delivery.settle(settlement):
                done = self.finished.setdefault(key, [])
                if done and done[-1] > delivery.offset:
                    self.errors.append(f"{key!r}: {delivery.offset} finished after {done[-1]}")
                done.append(delivery.offset)
                self.final.add(delivery.offset)
            self.check_position()


@pytest.mark.parametrize("seed", range(20))
async def test_random_interleavings_keep_the_partitions_promises(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kp, "DEAD_LETTER_RETRY_S", 0.001)
    monkeypatch.setattr(kp, "DEAD_LETTER_RETRY_MAX_S", 0.004)
    sim = Simulation(seed, max_held=random.Random(seed).choice([3, 6, 1000]))
    rng, offset = sim.rng, 0
    for _ in range(40):  # bounded: 40 fetches
        await asyncio.sleep(rng.random() * 0.003)
        if sim.paused or sim.work.full:
            continue
        count = rng.randint(1, 6)
        sim.work.feed(
            [Record(offset + i, rng.choice([b"a", b"b", b"c", None])) for i in range(count)]
        )
        offset += count
    for _ in range(400):  # bounded: 4 s
        await asyncio.sleep(0.01)
        if not sim.work.busy and not sim.work.held:
            break
    assert not sim.errors, sim.errors[:5]
    assert not sim.work.held and not sim.work.busy
    assert not sim.paused, "left paused with nothing to do"
    assert sim.work.position() == offset
