"""Fingerprints in the claim protocol: a re-serialized retry or an excluded field is a duplicate
under "json", the scheme is stored with the claim, and changing it does not turn the keys stored
under the old one into conflicts."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.fingerprints import KEEP_PAYLOAD_MAX_BYTES
from dedupe.claims.records import ClaimRequest, Reason
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action, Settlement

CH = "orders"


class Order(BaseModel):
    n: int


def order(key: str, body: str | bytes) -> MemoryDelivery:
    return MemoryDelivery(make_message(CH, body, message_id=key))


def order_app(calls: list[str], **options: object) -> App:
    app = App("t")

    @app.handler(CH, **options)  # type: ignore[arg-type]
    async def place(payload: Order, ctx: Context) -> dict[str, int]:
        calls.append(ctx.key)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        return {"n": payload.n}

    return app


@pytest.fixture
async def effects(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL)")
    return db


async def settle(app: App, store: ClaimStore, *deliveries: MemoryDelivery) -> list[Settlement]:
    """Each delivery in a batch of its own, in turn, as a redelivery would come."""
    async with Processor(app, store) as processor:
        for delivery in deliveries:
            await processor.process(CH, [delivery])
    return [d.settlements[-1] for d in deliveries]


def is_duplicate(settlement: Settlement) -> bool:
    return settlement.action is Action.ACK and settlement.duplicate


def is_conflict(settlement: Settlement) -> bool:
    return settlement.action is Action.DEAD_LETTER and settlement.reason is Reason.KEY_CONFLICT


async def test_a_reserialized_retry_is_a_duplicate_under_json(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Other key order, whitespace and number spelling: acknowledged, not run again; under the
    default raw fingerprint the same retry is a conflict."""
    first, retry = '{"n": 1, "sku": "a"}', '{\n "sku":"a",\n "n":1.0\n}'
    calls: list[str] = []
    outcomes = await settle(
        order_app(calls, fingerprint="json"), store, order("k", first), order("k", retry)
    )
    assert outcomes[0].action is Action.ACK and not outcomes[0].duplicate
    assert is_duplicate(outcomes[1])
    assert calls == ["k"]
    raw = await settle(order_app(calls), store, order("r", first), order("r", retry))
    assert is_conflict(raw[1])
    assert await effects.fetchval("SELECT count(*) FROM effects") == 2


async def test_an_excluded_field_does_not_conflict(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A producer stamping sent_at and a trace id on each retry sends the same payload; another
    value elsewhere is still a conflict."""
    calls: list[str] = []
    app = order_app(calls, fingerprint="json", fingerprint_exclude=("sent_at", "meta.trace"))
    outcomes = await settle(
        app,
        store,
        order("k", '{"n": 1, "sent_at": "10:00:00", "meta": {"trace": "a1", "v": 1}}'),
        order("k", '{"n": 1, "sent_at": "10:00:05", "meta": {"trace": "b2", "v": 1}}'),
        order("k", '{"n": 1, "meta": {"v": 1}}'),
        order("k", '{"n": 2, "sent_at": "10:00:09", "meta": {"trace": "c3", "v": 1}}'),
    )
    assert [is_duplicate(o) for o in outcomes] == [False, True, True, False]
    assert is_conflict(outcomes[3])
    assert calls == ["k"]


async def test_the_scheme_is_stored_with_the_claim(
    store: ClaimStore, effects: asyncpg.Connection, db: asyncpg.Connection
) -> None:
    """NULL for raw (as every claim made before fingerprints), the scheme's name otherwise,
    with the raw hash beside its hash."""
    calls: list[str] = []
    await settle(order_app(calls), store, order("raw", '{"n": 1}'))
    app = order_app(calls, fingerprint="json", fingerprint_exclude=("sent_at",))
    await settle(app, store, order("json", '{"n": 1}'))
    rows = {
        row["key"]: row
        for row in await db.fetch("SELECT key, fingerprint, raw_hash, payload FROM dedupe_claims")
    }
    assert (rows["raw"]["fingerprint"], rows["raw"]["raw_hash"]) == (None, None)
    assert rows["json"]["fingerprint"] == 'json exclude=["sent_at"]'
    assert rows["json"]["raw_hash"] == make_message(CH, '{"n": 1}').payload_hash
    assert rows["raw"]["payload"] is None and rows["json"]["payload"] is None


async def test_changing_a_handlers_fingerprint_does_not_make_its_stored_keys_conflict(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """raw -> json: a claim stored under raw is compared by its bytes, so a byte-identical copy
    stays a duplicate (and a re-serialized one a conflict, as it was); json -> json with
    exclusions -> raw: a claim stored under another scheme than raw is never a conflict."""
    calls: list[str] = []
    body = '{"n": 1, "sent_at": "10:00"}'
    raw, as_json = order_app(calls), order_app(calls, fingerprint="json")
    excluding = order_app(calls, fingerprint="json", fingerprint_exclude=("sent_at",))
    await settle(raw, store, order("old-raw", body))
    [same_bytes, reserialized] = await settle(
        as_json, store, order("old-raw", body), order("old-raw", '{"sent_at":"10:00","n":1}')
    )
    assert is_duplicate(same_bytes)
    assert is_conflict(reserialized)

    await settle(as_json, store, order("old-json", body))
    [other_stamp] = await settle(excluding, store, order("old-json", '{"n": 1, "sent_at": "11"}'))
    assert is_duplicate(other_stamp)
    [back_to_raw] = await settle(raw, store, order("old-json", '{"sent_at":"10:00","n":1}'))
    assert is_duplicate(back_to_raw)
    assert calls == ["old-raw", "old-json"]


async def test_a_take_over_under_a_new_scheme_stores_the_new_one(
    store: ClaimStore, effects: asyncpg.Connection, db: asyncpg.Connection
) -> None:
    """A dead worker's raw claim taken over by a json handler is run and compared under json
    from then on."""
    body = '{"n": 1}'
    [claim] = await store.claim_batch(
        [ClaimRequest("t.place", "k", make_message(CH, body).payload_hash)],
        lease_s=0.2,
        retention_s=3600,
    )
    assert claim.owned
    await asyncio.sleep(0.3)
    calls: list[str] = []
    app = order_app(calls, fingerprint="json")
    [taken, reserialized] = await settle(app, store, order("k", body), order("k", '{ "n" : 1 }'))
    assert taken.action is Action.ACK and not taken.duplicate
    assert is_duplicate(reserialized)
    assert calls == ["k"]
    assert await db.fetchval("SELECT fingerprint FROM dedupe_claims") == "json"


async def test_a_new_claim_keeps_its_first_payload_when_asked(
    store: ClaimStore, effects: asyncpg.Connection, db: asyncpg.Connection
) -> None:
    """keep_payload=True stores the body with the claim, up to 64 KiB; a larger one is not."""
    calls: list[str] = []
    app = order_app(calls, keep_payload=True)
    large = json.dumps({"n": 2, "pad": "x" * KEEP_PAYLOAD_MAX_BYTES})
    await settle(app, store, order("small", '{"n": 1}'), order("large", large))
    kept = dict(await db.fetch("SELECT key, payload FROM dedupe_claims"))  # type: ignore[arg-type]
    assert kept == {"small": b'{"n": 1}', "large": None}
