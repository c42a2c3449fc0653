"""The in-memory broker and transport (dedupe.testing.memory) under the real Worker and pipeline:
acks, duplicates, lost acks, deferrals, dead letters, and a consumer that goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pydantic import BaseModel

from dedupe import App, Context, Reject, Worker
from dedupe.claims.records import Reason
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.testing.memory import MemoryBroker, MemoryTransport

CH = "orders"


class Order(BaseModel):
    n: int


def order_app(calls: list[str], *, gate: asyncio.Event | None = None) -> App:
    app = App("mem")

    @app.handler(CH, lease_s=5)
    async def place(order: Order, ctx: Context) -> dict[str, int]:
        calls.append(ctx.key)
        if gate is not None:
            await gate.wait()
        if order.n < 0:
            raise Reject("negative")
        return {"n": order.n}

    return app


@contextlib.asynccontextmanager
async def serving(app: App, transport: MemoryTransport, db_url: str) -> AsyncIterator[Worker]:
    async with Worker(app, transport=transport, database_url=db_url, concurrency=4) as worker:
        yield worker


async def test_a_worker_on_the_memory_transport_acks_once_and_a_duplicate_as_a_duplicate(
    db_url: str,
) -> None:
    """Published twice one after the other: one run, then an ack as a duplicate with the result."""
    calls: list[str] = []
    transport = MemoryTransport()
    async with serving(order_app(calls), transport, db_url):
        first = transport.publish(CH, {"n": 1}, message_id="o-1")
        await transport.wait_idle(10)
        again = transport.publish(CH, b'{"n":1}', message_id="o-1")
        await transport.wait_idle(10)
    assert calls == ["o-1"]
    assert first.outcome is not None and first.outcome.result == {"n": 1}
    assert again.outcome is not None and again.outcome.duplicate
    assert [s.fate for s in transport.broker.log] == ["acked", "acked"]


async def test_concurrent_copies_run_once_and_the_deferred_copy_comes_back_soon(
    db_url: str,
) -> None:
    """Two copies at once: one runs, the other finds the key in flight, is deferred (the delay
    compressed to max_delay_s) and is acked as a duplicate."""
    calls: list[str] = []
    gate = asyncio.Event()
    transport = MemoryBroker(max_delay_s=0.05).transport()
    async with serving(order_app(calls, gate=gate), transport, db_url):
        sent = transport.broker.publish(CH, {"n": 2}, message_id="o-2", copies=2)
        await asyncio.sleep(0.3)
        gate.set()
        await transport.wait_idle(10)
    assert calls == ["o-2"]
    fates = [s.fate for s in sent.log]
    assert fates.count("acked") == 2 and "redelivered" in fates
    assert sum(s.duplicate for s in sent.log if s.fate == "acked") == 1


async def test_a_lost_ack_is_delivered_again_and_acked_as_a_duplicate(db_url: str) -> None:
    """The broker never got the first ack: the message comes again, the handler does not run."""
    calls: list[str] = []
    transport = MemoryTransport()
    async with serving(order_app(calls), transport, db_url):
        sent = transport.broker.publish(CH, {"n": 3}, message_id="o-3", lose_ack=True)
        await transport.wait_idle(10)
    assert calls == ["o-3"]
    assert [s.fate for s in sent.log] == ["ack_lost", "acked"]
    assert sent.log[-1].duplicate and sent.log[-1].message.attempt == 2


async def test_a_dead_letter_carries_its_reason_in_the_headers_the_real_brokers_use(
    db_url: str,
) -> None:
    """A rejected message is dead-lettered once, with x-dedupe-reason and the claim's key."""
    transport = MemoryTransport()
    async with serving(order_app([]), transport, db_url):
        transport.publish(CH, {"n": -1}, message_id="o-4")
        await transport.wait_idle(10)
    [dead] = transport.broker.dead_letters
    assert dead.reason is Reason.REJECTED and dead.detail == "negative"
    assert dead.headers["x-dedupe-reason"] == "rejected"
    assert dead.headers["x-dedupe-key"] == "o-4"


async def test_what_a_disconnected_consumer_left_unsettled_goes_to_another_and_its_acks_are_dropped(
    db_url: str,
) -> None:
    """A consumer whose connection drops mid-run: the broker hands the delivery to the other
    consumer; the first one's late settlement reaches nobody."""
    calls: list[str] = []
    gate = asyncio.Event()
    app = order_app(calls, gate=gate)
    broker = MemoryBroker(max_delay_s=0.05)
    first, second = broker.transport("first"), broker.transport("second")
    stop = asyncio.Event()
    async with (
        ClaimStore.open(db_url, owner="first") as store_a,
        ClaimStore.open(db_url, owner="second") as store_b,
        Processor(app, store_a) as a,
    ):
        serving_a = asyncio.create_task(first.serve([CH], a.process, stop))
        sent = broker.publish(CH, {"n": 5}, message_id="o-5")
        for _ in range(100):
            if first.in_flight:
                break
            await asyncio.sleep(0.01)
        first.disconnect()
        async with Processor(app, store_b) as b:
            serving_b = asyncio.create_task(second.serve([CH], b.process, stop))
            await asyncio.sleep(0.2)  # b is deferred: a still holds the key
            gate.set()
            await broker.idle(10)
            stop.set()
            await asyncio.gather(serving_a, serving_b)
            await b.drain(timeout_s=5)
        await a.drain(timeout_s=5)
    fates = {(s.consumer, s.fate) for s in sent.log}
    assert ("first", "dropped") in fates
    assert ("second", "acked") in fates
    assert calls == ["o-5"]  # the second consumer's copy was a duplicate of the first's run


async def test_a_memory_delivery_made_by_hand_records_its_settlements() -> None:
    """MemoryDelivery (dedupe.testing.memory) outside any broker: settle() records and says True."""
    from dedupe.transport import ACK

    delivery = MemoryDelivery(make_message(CH, "{}", message_id="x"))
    assert await delivery.settle(ACK) is True
    assert delivery.outcome is ACK and delivery.settled.is_set()
