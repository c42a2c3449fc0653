"""Fingerprints and conflicts on both real brokers: a re-serialized retry is a duplicate under
"json", a real conflict reaches <channel>.dlq with both fingerprints and its diff, and settling
it runs the second payload under a new key (through the outbox relay) or discards it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.store import ClaimStore
from dedupe.observability.activity import Activity
from dedupe.operations.claims import ClaimAdmin
from dedupe.transport import Publisher
from dedupe_kafka.publisher import KafkaPublisher
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from tests.conftest import eventually, running
from tests.integration.brokers import Broker


class Order(BaseModel):
    order: str
    amount: int


def order(amount: int, sent_at: str, *, spaced: bool = False) -> bytes:
    document = {"order": "o-1", "amount": amount, "sent_at": sent_at}
    if spaced:  # another producer's serializer: other key order, other whitespace
        return json.dumps(dict(reversed(document.items())), indent=2).encode()
    return json.dumps(document, separators=(",", ":")).encode()


def keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


@pytest.fixture
async def publisher(broker: Broker) -> AsyncIterator[Publisher]:
    """The relay's publisher for the broker under test (ctx.publish and run-as copies)."""
    url: str = broker.url  # type: ignore[attr-defined]
    made: Publisher = RabbitMQPublisher(url) if broker.name == "rabbitmq" else KafkaPublisher(url)
    yield made
    await made.close()


async def test_conflicts_on_the_broker_are_told_apart_from_retries_and_settled_both_ways(
    broker: Broker,
    channel: str,
    store: ClaimStore,
    db: asyncpg.Connection,
    publisher: Publisher,
) -> None:
    """Retry: duplicate. Conflict: dead letter with fingerprints and diff. --run-as: runs once
    under the new key. --discard: nothing runs."""
    calls: list[tuple[str, int]] = []
    app = App("t")

    @app.handler(
        channel,
        key="header:Idempotency-Key",
        fingerprint="json",
        fingerprint_exclude=("sent_at",),
        keep_payload=True,
    )
    async def place(payload: Order, ctx: Context) -> None:
        calls.append((ctx.key, payload.amount))

    await broker.publish(channel, [(order(100, "10:00"), keyed("k"), "m-1")])
    await broker.publish(channel, [(order(100, "10:00"), keyed("j"), "m-4")])
    async with (
        Activity(store) as activity,
        running(
            app, store, broker.transport(), observers=[activity], publisher=publisher
        ) as worker,
    ):

        async def first_runs() -> bool:
            return worker.stats.completed == 2

        await eventually(first_runs)
        await broker.publish(
            channel,
            [
                (order(100, "10:07", spaced=True), keyed("k"), "m-2"),  # the producer's retry
                (order(250, "10:09"), keyed("k"), "m-3"),  # another payload under k
                (order(300, "10:09"), keyed("j"), "m-5"),  # another payload under j
            ],
        )

        async def settled_copies() -> bool:
            return worker.stats.duplicates == 1 and worker.stats.conflicts == 2

        await eventually(settled_copies)
        # Counted at the verdict; the record's statement and the dead letter follow it.
        letters: dict[str, dict[str, Any]] = {}

        async def dead_lettered() -> bool:
            letters.update((x["message_id"], x) for x in await broker.dead_letters(channel))
            return set(letters) == {"m-3", "m-5"}

        await eventually(dead_lettered)
        assert worker.stats.conflicts == 2
        letter = letters["m-3"]
        assert (letter["reason"], letter["scope"], letter["key"]) == (
            "key_conflict",
            "t.place",
            "k",
        )
        assert letter["diff"] == "~ amount (number)"
        assert letter["fingerprint"].startswith('json exclude=["sent_at"] ')
        assert letter["claimed_fingerprint"].startswith('json exclude=["sent_at"] ')
        assert letter["fingerprint"] != letter["claimed_fingerprint"]

        await activity.flush()
        admin = ClaimAdmin(store)
        settled = await admin.settle_conflict("t.place", "k", run_as="k-2")
        assert settled.message_id == "m-3"
        discarded = await admin.settle_conflict("t.place", "j", run_as=None)
        assert discarded.how == "discarded"
        worker.relay.wake()  # type: ignore[union-attr]

        async def ran_under_the_new_key() -> bool:
            return ("k-2", 250) in calls

        await eventually(ran_under_the_new_key)
        await asyncio.sleep(0.5)  # nothing else may arrive
    assert sorted(calls) == [("j", 100), ("k", 100), ("k-2", 250)]
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL") == 0
    shown = await ClaimAdmin(store).show("t.place", "k-2")
    assert shown is not None and shown["status"] == "completed"
