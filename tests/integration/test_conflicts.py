"""Conflicts people can act on, against a real PostgreSQL: the dead letter and the history event
carry both fingerprints and the diff, `claims show` shows them, and the conflict's record keeps
the second payload (keep_payload) for as long as the claim lives."""

from __future__ import annotations

import json

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.records import Reason
from dedupe.claims.store import ClaimStore
from dedupe.observability.activity import Activity
from dedupe.operations.claims import ClaimAdmin
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action, dead_letter_headers

CH = "orders"
FIRST = b'{"n": 1, "amount": 1000, "note": "card 4242", "sent_at": "10:00"}'
SECOND = b'{"n": 1, "amount": 1200, "coupon": "SECRET10", "sent_at": "10:05"}'


class Order(BaseModel):
    n: int


def order(key: str, body: bytes, message_id: str = "m") -> MemoryDelivery:
    return MemoryDelivery(
        make_message(CH, body, message_id=message_id, headers={"Idempotency-Key": key})
    )


def order_app(calls: list[str], **options: object) -> App:
    app = App("t")

    @app.handler(CH, key="header:Idempotency-Key", **options)  # type: ignore[arg-type]
    async def place(payload: Order, ctx: Context) -> None:
        calls.append(ctx.key)

    return app


async def run(app: App, store: ClaimStore, *deliveries: MemoryDelivery) -> None:
    """As `dedupe-worker run` does: with the activity that records conflicts, flushed at exit."""
    async with (
        Activity(store) as activity,
        Processor(app, store, observers=[activity]) as processor,
    ):
        for delivery in deliveries:
            await processor.process(CH, [delivery])


async def test_a_real_conflict_shows_its_diff_in_claims_show(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Both fingerprints and the paths that differ, on the dead letter, in the history and in
    `claims show`; never a value of either payload."""
    calls: list[str] = []
    app = order_app(calls, fingerprint="json", fingerprint_exclude=("sent_at",), keep_payload=True)
    conflicting = order("k", SECOND, message_id="m-2")
    await run(app, store, order("k", FIRST, message_id="m-1"), conflicting)
    assert calls == ["k"]

    settlement = conflicting.settlements[-1]
    assert (settlement.action, settlement.reason) == (Action.DEAD_LETTER, Reason.KEY_CONFLICT)
    headers = dead_letter_headers(settlement)
    diff = "~ amount (number); + coupon (string); - note (string)"
    assert headers["x-dedupe-diff"] == diff
    assert headers["x-dedupe-fingerprint"].startswith('json exclude=["sent_at"] ')
    assert headers["x-dedupe-claimed-fingerprint"].startswith('json exclude=["sent_at"] ')

    shown = await ClaimAdmin(store).show("t.place", "k")
    assert shown is not None
    assert (shown["fingerprint"], shown["payload_bytes"]) == (
        'json exclude=["sent_at"]',
        len(FIRST),
    )
    [conflict] = shown["conflicts"]
    assert conflict["diff"] == ["~ amount (number)", "+ coupon (string)", "- note (string)"]
    assert conflict["fingerprint"] == headers["x-dedupe-fingerprint"]
    assert conflict["claimed_fingerprint"] == headers["x-dedupe-claimed-fingerprint"]
    assert (conflict["payload_bytes"], conflict["message_id"], conflict["settled"]) == (
        len(SECOND),
        "m-2",
        None,
    )
    [event] = [e for e in shown["history"] if e["event"] == "conflict"]
    assert "~ amount (number)" in event["detail"]
    assert headers["x-dedupe-fingerprint"].split()[-1][:12] in event["detail"]
    everything = str(shown) + str(headers)
    assert not any(value in everything for value in ("4242", "SECRET10", "1000", "1200"))
    stored = await db.fetchval("SELECT payload FROM dedupe_conflicts")
    assert stored == SECOND


async def test_a_conflicting_message_delivered_again_is_one_record(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Three copies of one conflicting message: three dead letters, one record counting three."""
    calls: list[str] = []
    app = order_app(calls, keep_payload=True)
    copies = [order("k", SECOND) for _ in range(3)]
    await run(app, store, order("k", FIRST), *copies)
    assert all(c.settlements[-1].reason is Reason.KEY_CONFLICT for c in copies)
    rows = await db.fetch("SELECT deliveries, diff::text FROM dedupe_conflicts")
    assert [r["deliveries"] for r in rows] == [3]


async def test_without_keep_payload_a_conflict_has_fingerprints_but_no_diff(
    store: ClaimStore,
) -> None:
    """Nothing of either payload is stored; the record says why there is no diff."""
    calls: list[str] = []
    await run(order_app(calls), store, order("k", FIRST), order("k", SECOND))
    shown = await ClaimAdmin(store).show("t.place", "k")
    assert shown is not None and shown["payload_bytes"] is None
    [conflict] = shown["conflicts"]
    assert conflict["diff"] is None and "kept no payload" in conflict["note"]
    assert conflict["payload_bytes"] is None
    assert conflict["fingerprint"].startswith("raw ")


@pytest.mark.parametrize("how", ["gc", "purge"])
async def test_a_conflict_goes_with_its_claim(
    store: ClaimStore, db: asyncpg.Connection, how: str
) -> None:
    """Same retention as the claim: clean-up and purges delete its conflicts too."""
    calls: list[str] = []
    await run(order_app(calls, keep_payload=True), store, order("k", FIRST), order("k", SECOND))
    assert await db.fetchval("SELECT count(*) FROM dedupe_conflicts") == 1
    await db.execute("UPDATE dedupe_claims SET expires_at = now() - interval '1 s'")
    if how == "gc":
        cleaned = await store.gc()
        assert cleaned is not None and cleaned.claims == 1
    else:
        await db.execute("UPDATE dedupe_claims SET updated_at = now() - interval '1 day'")
        assert await ClaimAdmin(store).purge(older_than_s=3600) == 1
    assert await db.fetchval("SELECT count(*) FROM dedupe_conflicts") == 0


# -- settling ----------------------------------------------------------------------------------


async def relayed(db: asyncpg.Connection) -> list[MemoryDelivery]:
    """What a worker's outbox relay would publish, as the broker would deliver it."""
    rows = await db.fetch(
        "SELECT channel, message_id, body, headers::text AS headers, content_type"
        " FROM dedupe_outbox WHERE sent_at IS NULL ORDER BY id"
    )
    await db.execute("UPDATE dedupe_outbox SET sent_at = now()")
    return [
        MemoryDelivery(
            make_message(
                row["channel"],
                bytes(row["body"]),
                message_id=row["message_id"],
                headers=json.loads(row["headers"]),
            )
        )
        for row in rows
    ]


def two_handler_app(calls: list[tuple[str, str]]) -> App:
    """`place` conflicts; `audit`, keyed by message id on the same channel, ran the message."""
    app = App("t")

    @app.handler(CH, key="header:Idempotency-Key", keep_payload=True)
    async def place(payload: Order, ctx: Context) -> None:
        calls.append(("place", ctx.key))

    @app.handler(CH)
    async def audit(payload: Order, ctx: Context) -> None:
        calls.append(("audit", ctx.key))

    return app


async def test_a_conflict_settled_with_run_as_runs_the_second_payload_under_the_new_key(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The second payload goes out through the outbox with the new key for its scope alone:
    the conflicting handler runs it once, the channel's other handler sees a duplicate."""
    calls: list[tuple[str, str]] = []
    app = two_handler_app(calls)
    await run(app, store, order("k", FIRST, "m-1"), order("k", SECOND, "m-2"))
    assert calls == [("place", "k"), ("audit", "m-1"), ("audit", "m-2")]

    settled = await ClaimAdmin(store).settle_conflict("t.place", "k", run_as="k-2")
    assert (settled.how, settled.channel) == ("run as k-2", CH)
    [copy] = await relayed(db)
    assert (copy.message.message_id, copy.message.body) == ("m-2", SECOND)
    assert copy.message.headers["Idempotency-Key"] == "k"  # the sender's headers, as sent
    await run(app, store, copy)
    assert calls[3:] == [("place", "k-2")]
    assert copy.settlements[-1].action is Action.ACK

    shown = await ClaimAdmin(store).show("t.place", "k")
    assert shown is not None
    [conflict] = shown["conflicts"]
    assert (conflict["settled"], conflict["payload_bytes"]) == ("run as k-2", None)
    assert conflict["settled_at"] is not None
    [event] = [e for e in shown["history"] if e["event"] == "conflict_settled"]
    assert "k-2" in event["detail"]
    new = await ClaimAdmin(store).show("t.place", "k-2")
    assert new is not None and new["status"] == "completed"


async def test_a_conflict_settled_by_discarding_drops_the_second_payload(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Nothing is published; the record keeps its fingerprints and diff, not the payload."""
    calls: list[tuple[str, str]] = []
    await run(two_handler_app(calls), store, order("k", FIRST, "m-1"), order("k", SECOND, "m-2"))
    settled = await ClaimAdmin(store).settle_conflict("t.place", "k", run_as=None)
    assert settled.how == "discarded"
    assert await relayed(db) == []
    row = await db.fetchrow("SELECT payload, settled, diff::text AS diff FROM dedupe_conflicts")
    assert (row["payload"], row["settled"]) == (None, "discarded")
    assert "amount" in row["diff"]
    history = await db.fetch("SELECT event, detail FROM dedupe_claim_events WHERE key = 'k'")
    assert [r["detail"] for r in history if r["event"] == "conflict_settled"] == [
        "discarded the second payload (" + settled.fingerprint + ")"
    ]


async def test_settling_refuses_what_it_cannot_do_and_says_why(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """No conflict, a settled one, two at once, a payload not kept, a new key in use."""
    from dedupe.operations.claims import NotSettled

    calls: list[tuple[str, str]] = []
    app = two_handler_app(calls)
    admin = ClaimAdmin(store)
    with pytest.raises(NotSettled, match="no unsettled conflict"):
        await admin.settle_conflict("t.place", "k", run_as=None)
    third = b'{"n": 3}'
    await run(app, store, order("k", FIRST), order("k", SECOND), order("k", third))
    with pytest.raises(NotSettled, match=r"2 unsettled conflicts \(ids \d+, \d+\).*--id"):
        await admin.settle_conflict("t.place", "k", run_as=None)
    [first_id, second_id] = [r["id"] for r in await admin.conflicts(scope="t.place")][::-1]
    with pytest.raises(NotSettled, match="already claimed"):
        await admin.settle_conflict("t.place", "k", run_as="k", conflict_id=first_id)
    await admin.settle_conflict("t.place", "k", run_as=None, conflict_id=first_id)
    with pytest.raises(NotSettled, match="no unsettled conflict"):
        await admin.settle_conflict("t.place", "k", run_as="k-9", conflict_id=first_id)
    await db.execute("UPDATE dedupe_conflicts SET payload = NULL WHERE id = $1", second_id)
    with pytest.raises(NotSettled, match="was not kept"):
        await admin.settle_conflict("t.place", "k", run_as="k-9")
    with pytest.raises(NotSettled, match="NUL"):
        await admin.settle_conflict("t.place", "k", run_as="bad\x00key")


async def test_the_status_page_shows_unsettled_conflicts_with_their_diff(
    store: ClaimStore,
) -> None:
    """A table of its own: scope, key, both fingerprints (short) and what differs, escaped."""
    import httpx
    from starlette.applications import Starlette

    from dedupe_receiver.status_page import StatusPage

    calls: list[str] = []
    app = order_app(calls, keep_payload=True, fingerprint="json")
    await run(app, store, order("k<1>", FIRST), order("k<1>", SECOND))
    page = Starlette(routes=StatusPage(store).routes())
    transport = httpx.ASGITransport(app=page, client=("127.0.0.1", 5000))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        html = (await http.get("/status")).text
    section = html.split("<table id='conflicts'>", 1)[1].split("</table>", 1)[0]
    assert "k&lt;1&gt;" in section and "t.place" in section
    assert "~ amount (number)" in section and "+ coupon (string)" in section
    assert "conflicts settle" in html
    assert not any(value in html for value in ("4242", "SECRET10"))
