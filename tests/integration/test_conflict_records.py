"""Conflict records are durable before the message is settled, against a real PostgreSQL (and
RabbitMQ behind the receiver): a worker's dead letter, the receiver's and the HTTP
middleware's 422 wait for the record's commit; a flood of one payload is one row counting its
deliveries, never records dropped by a buffer. No activity observer runs here: what the
processes buffer (counts) is not what these tests read."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.records import Reason
from dedupe.claims.store import ClaimStore
from dedupe.operations.claims import ClaimAdmin, NotSettled
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action, Settlement
from dedupe.webhooks import api_key
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_receiver.application import create_receiver
from handlers.orders_api import setup
from tests.apps.http_api import create_test_api
from tests.integration.http_server import serving

CH = "orders"
FIRST = b'{"n": 1, "amount": 1000}'
SECOND = b'{"n": 1, "amount": 1200}'
RECORDS = "SELECT deliveries, payload FROM dedupe_conflicts ORDER BY id"


class Order(BaseModel):
    n: int


def order_app() -> App:
    app = App("t")

    @app.handler(CH, key="header:Idempotency-Key", keep_payload=True)
    async def place(payload: Order, ctx: Context) -> None:
        pass

    return app


def order(key: str, body: bytes, message_id: str = "m") -> MemoryDelivery:
    return MemoryDelivery(
        make_message(CH, body, message_id=message_id, headers={"Idempotency-Key": key})
    )


class Watched(MemoryDelivery):
    """A delivery that reads the conflict records at the moment the broker is told to settle
    it: what a worker killed right after its dead letter went out leaves behind."""

    def __init__(self, delivery: MemoryDelivery, db: asyncpg.Connection) -> None:
        super().__init__(delivery.message)
        self.db = db
        self.seen: list[tuple[Action, list[asyncpg.Record]]] = []

    async def settle(self, settlement: Settlement) -> bool:
        self.seen.append((settlement.action, await self.db.fetch(RECORDS)))
        return await super().settle(settlement)


async def test_a_conflict_is_recorded_before_its_dead_letter_goes_out(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """When the broker is told to dead-letter the conflicting message, its record (with the
    second payload, for `conflicts settle --run-as`) and its event have committed already."""
    conflicting = Watched(order("k", SECOND, "m-2"), db)
    async with Processor(order_app(), store) as processor:
        await processor.process(CH, [order("k", FIRST, "m-1")])
        await processor.process(CH, [conflicting])
        [(action, records)] = conflicting.seen
        assert action is Action.DEAD_LETTER
        assert [(r["deliveries"], r["payload"]) for r in records] == [(1, SECOND)]
        events = await db.fetch("SELECT event FROM dedupe_claim_events WHERE key = 'k'")
        assert [e["event"] for e in events] == ["conflict"]
        settled = await ClaimAdmin(store).settle_conflict("t.place", "k", run_as="k-2")
        assert settled.message_id == "m-2"


async def test_a_flood_of_one_payload_is_one_row_counting_every_copy(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """300 copies of one conflicting payload (in batches, as a broker hands them over): 300
    dead letters, one record counting 300 and one `conflict` event; nothing waits in memory."""
    copies = [order("k", SECOND, f"m-{i}") for i in range(300)]
    async with Processor(order_app(), store) as processor:
        await processor.process(CH, [order("k", FIRST)])
        for start in range(0, len(copies), 50):
            await processor.process(CH, copies[start : start + 50])
        assert all(c.settlements[-1].reason is Reason.KEY_CONFLICT for c in copies)
        assert [r["deliveries"] for r in await db.fetch(RECORDS)] == [300]
        assert (
            await db.fetchval("SELECT count(*) FROM dedupe_claim_events WHERE event = 'conflict'")
            == 1
        )


async def test_every_other_payload_is_a_row_of_its_own(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Two other payloads under one key are two rows; 150 keys each refused another payload
    are 150 rows (a buffer of 100 per flush used to drop the rest)."""
    async with Processor(order_app(), store) as processor:
        await processor.process(CH, [order("k", FIRST)])
        await processor.process(CH, [order("k", SECOND), order("k", b'{"n": 1, "amount": 9}')])
        assert [r["deliveries"] for r in await db.fetch(RECORDS)] == [1, 1]
        keys = [f"key-{i}" for i in range(150)]
        await processor.process(CH, [order(k, FIRST, f"{k}-a") for k in keys])
        await processor.process(CH, [order(k, SECOND, f"{k}-b") for k in keys])
        counted = await db.fetchval("SELECT count(*) FROM dedupe_conflicts WHERE key <> 'k'")
        assert counted == 150


async def test_a_conflict_that_cannot_be_recorded_is_requeued_not_dead_lettered(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """No dead letter without its record: the message goes back to the broker, and its
    redelivery, once the table is back, is recorded and dead-lettered."""
    async with Processor(order_app(), store) as processor:
        await processor.process(CH, [order("k", FIRST)])
        await db.execute("ALTER TABLE dedupe_conflicts RENAME TO dedupe_conflicts_away")
        refused = order("k", SECOND)
        await processor.process(CH, [refused])
        assert refused.settlements[-1].action is Action.REQUEUE
        await db.execute("ALTER TABLE dedupe_conflicts_away RENAME TO dedupe_conflicts")
        again = order("k", SECOND)
        await processor.process(CH, [again])
        assert again.settlements[-1].reason is Reason.KEY_CONFLICT
        assert [r["deliveries"] for r in await db.fetch(RECORDS)] == [1]


# -- the webhook receiver ----------------------------------------------------------------------

API_KEY = "api-key-records-9f2e"


@pytest.fixture
async def publisher(amqp_url: str) -> AsyncIterator[RabbitMQPublisher]:
    publisher = RabbitMQPublisher(amqp_url)
    yield publisher
    await publisher.close()


async def test_a_webhook_conflict_can_be_run_under_a_new_key_as_soon_as_it_is_answered(
    channel: str, store: ClaimStore, publisher: RabbitMQPublisher, db: asyncpg.Connection
) -> None:
    """The 422's second body, which nothing else holds (nothing was published), is in its
    record when the sender reads the 422: `conflicts settle --run-as` works at once, while the
    receiver runs (its buffered counts not flushed)."""
    app = App("hooks")
    app.webhook(
        "orders",
        verify=api_key({API_KEY: "tenant-a"}),
        key="header:Idempotency-Key",
        channel=channel,
        keep_payload=True,
    )
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {API_KEY}",
        "Idempotency-Key": "k",
    }
    receiver = create_receiver(app, store=store, publisher=publisher)
    async with receiver.router.lifespan_context(receiver):
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as http:
            first = await http.post("/webhooks/orders", content=b'{"n": 1}', headers=headers)
            other = await http.post("/webhooks/orders", content=b'{"n": 2}', headers=headers)
            assert (first.status_code, other.status_code) == (202, 422)
            settled = await ClaimAdmin(store).settle_conflict(
                "hooks.webhook:orders/tenant-a", "k", run_as="k-2"
            )
            assert settled.message_id == "orders/tenant-a/k-2"
            body = await db.fetchval("SELECT body FROM dedupe_outbox")
            assert body == b'{"n": 2}'


# -- the HTTP middleware -----------------------------------------------------------------------


async def test_an_http_422_is_recorded_listed_and_settled_by_discarding(
    db_url: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Each other request under a used key is a record before its 422 goes out (the same one
    again counts a delivery); `conflicts list` shows it with its method and path, never its
    query or body; --run-as is refused with what to do, --discard settles it."""
    await setup(db_url)
    headers = {"Authorization": "Bearer alice-secret-token", "Idempotency-Key": "o-1"}
    async with (
        serving(create_test_api(db_url)) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        first = await client.post("/orders", json={"sku": "book"}, headers=headers)
        assert first.status_code == 201, first.text
        for _ in range(2):
            other = await client.post(
                "/orders", json={"sku": "secret-sku"}, params={"token": "q-secret"}, headers=headers
            )
            assert other.status_code == 422, other.text
        admin = ClaimAdmin(store)
        [listed] = await admin.conflicts()
    assert listed["key"] == "o-1" and listed["deliveries"] == 2
    assert listed["http_request"] == "POST /orders"
    assert "another request" in listed["note"]
    assert not any(secret in str(listed) for secret in ("secret-sku", "q-secret", "alice"))
    scope = listed["scope"]
    with pytest.raises(NotSettled, match=r"new Idempotency-Key.*--discard"):
        await admin.settle_conflict(scope, "o-1", run_as="o-2")
    settled = await admin.settle_conflict(scope, "o-1", run_as=None)
    assert (settled.how, settled.http_request) == ("discarded", "POST /orders")
    assert await admin.conflicts() == []
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 0
