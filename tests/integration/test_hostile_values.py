"""One message's hostile value fails only that message, on both brokers: keys and tenants the
claims table cannot hold are dead-lettered as invalid_key, results jsonb cannot hold are stored
in a form it can, and the messages batched beside them settle normally, once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.records import ClaimRequest, Fence, Reason
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action
from tests.conftest import eventually, running
from tests.integration.brokers import Broker

CH = "work"

# Keys that PostgreSQL's text cannot hold or the primary key cannot index, each in the JSON
# body where the handler's key= looks (a JSON "\ud800" decodes to a lone surrogate).
HOSTILE_BODIES = {
    "nul": b'{"id": "a\\u0000b", "note": "x"}',
    "surrogate": b'{"id": "a\\ud800b", "note": "x"}',
    "long": json.dumps({"id": "k" * 600, "note": "x"}).encode(),
}
# Results jsonb refuses as they come: a NUL, a lone surrogate, NaN.
HOSTILE_NOTES: dict[str, Any] = {
    "r-nul": "a\x00b",
    "r-surrogate": "a\ud800b",
    "r-nan": float("nan"),
}


class Order(BaseModel):
    id: str
    note: str


def tenant_app(channel: str, calls: list[str], *, writes: bool) -> App:
    app = App("t")

    @app.handler(channel, key="body:id", scope="header:X-Tenant")
    async def work(order: Order, ctx: Context) -> dict[str, Any]:
        calls.append(ctx.key)
        if writes:
            await ctx.db.execute("INSERT INTO effects VALUES ($1)", ctx.key)
        return {"note": HOSTILE_NOTES.get(order.id, order.note)}

    return app


def good(i: int) -> tuple[bytes, dict[str, str], str]:
    return json.dumps({"id": f"g{i}", "note": "fine"}).encode(), {"X-Tenant": "acme"}, f"g{i}"


async def test_hostile_keys_and_tenants_are_dead_lettered_and_their_batch_mates_complete(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """NUL, a lone surrogate, 600 characters in the key, a tenant header of 4 KB: each is
    dead-lettered once with reason invalid_key; the good messages around them run once."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    calls: list[str] = []
    messages = [good(i) for i in range(20)]
    for name, raw in HOSTILE_BODIES.items():
        messages.insert(3 + len(name), (raw, {"X-Tenant": "acme"}, name))
    tenant = json.dumps({"id": "big-tenant", "note": "x"}).encode()
    messages.insert(10, (tenant, {"X-Tenant": "t" * 4096}, "big-tenant"))
    await broker.publish(channel, messages, partition=0)
    async with running(tenant_app(channel, calls, writes=True), store, broker.transport()) as w:

        async def settled() -> bool:
            return w.stats.completed == 20 and w.stats.dead_lettered["invalid_key"] == 4

        await eventually(settled)
        assert w.stats.requeued == 0 and w.stats.deferred == 0
    assert sorted(calls) == sorted(f"g{i}" for i in range(20))
    assert await db.fetchval("SELECT count(DISTINCT key) FROM effects") == 20
    assert await db.fetchval("SELECT count(*) FROM effects") == 20
    letters = await broker.dead_letters(channel)
    assert sorted(letter["message_id"] for letter in letters) == sorted(
        [*HOSTILE_BODIES, "big-tenant"]
    )
    assert {letter["reason"] for letter in letters} == {"invalid_key"}
    assert await broker.backlog(channel) == 0  # on Kafka: nothing pins the commit position


@pytest.mark.parametrize("writes", [False, True], ids=["no ctx.db", "ctx.db"])
async def test_results_jsonb_cannot_hold_are_stored_mended_and_nothing_runs_twice(
    broker: Broker, channel: str, store: ClaimStore, db: asyncpg.Connection, writes: bool
) -> None:
    """Results with NUL, a lone surrogate or NaN, returned without ctx.db (so they share the
    batched completion with others) and with it: each message completes once, the stored
    result keeps its shape with U+FFFD / null in place of what jsonb refuses."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    calls: list[str] = []
    messages = [good(i) for i in range(10)]
    for name in HOSTILE_NOTES:
        raw = json.dumps({"id": name, "note": "x"}).encode()
        messages.insert(2, (raw, {"X-Tenant": "a"}, name))
    await broker.publish(channel, messages, partition=0)
    async with running(tenant_app(channel, calls, writes=writes), store, broker.transport()) as w:

        async def settled() -> bool:
            return w.stats.completed == 13

        await eventually(settled)
        await asyncio.sleep(0.5)  # a requeued or lapsed message would be back by now
        assert (w.stats.requeued, w.stats.deferred, w.stats.taken_over) == (0, 0, 0)
    assert sorted(calls) == sorted([*(f"g{i}" for i in range(10)), *HOSTILE_NOTES])
    rows = await db.fetch(
        "SELECT key, result FROM dedupe_claims WHERE scope = 't.work/a' AND status = 'completed'"
    )
    assert {row["key"]: json.loads(row["result"]) for row in rows} == {
        "r-nul": {"note": "a\ufffdb"},
        "r-surrogate": {"note": "a\ufffdb"},
        "r-nan": {"note": None},
    }
    assert await broker.backlog(channel) == 0


async def test_a_claim_statement_refused_for_one_value_is_split_around_it(
    store: ClaimStore,
) -> None:
    """A batch holding a key PostgreSQL refuses (bypassing the pipeline's own check) claims the
    others and answers `refused` for that one alone."""
    requests = [ClaimRequest("s", f"k{i}", b"h") for i in range(7)]
    requests.insert(4, ClaimRequest("s", "bad\x00", b"h"))
    claims = await store.claim_batch(requests, lease_s=30, retention_s=3600)
    assert [c.key for c in claims if c.owned] == [f"k{i}" for i in range(7)]
    [refused] = [c for c in claims if not c.owned]
    assert refused.key == "bad\x00" and "0x00" in (refused.refused or "")


async def test_a_completion_refused_for_one_result_stores_a_marker_for_it_alone(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A result jsonb refuses (bypassing encode_result) is stored as a marker saying why; the
    other outcomes of its statement are recorded as usual."""
    requests = [ClaimRequest("s", f"k{i}", b"h") for i in range(5)]
    claims = await store.claim_batch(requests, lease_s=30, retention_s=3600)
    outcomes = [(Fence("s", c.key, c.token or 0), '{"ok": 1}', 3600.0) for c in claims]
    outcomes[2] = (outcomes[2][0], '{"bad": "\\u0000"}', 3600.0)
    done = await store.complete(outcomes)
    assert done == {("s", f"k{i}") for i in range(5)}
    rows = {
        r["key"]: json.loads(r["result"])
        for r in await db.fetch("SELECT key, result FROM dedupe_claims")
    }
    assert rows["k0"] == {"ok": 1}
    assert "refused" in rows["k2"]["dedupe_result_dropped"]


async def test_an_error_text_with_nul_is_recorded_and_the_message_dead_lettered(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A handler whose exception message holds NUL and a lone surrogate: the attempt and the
    failure are recorded (the text mended), the message dead-lettered, not requeued."""
    app = App("t")

    @app.handler(CH, max_attempts=2, backoff_s=0.01, max_backoff_s=0.01)
    async def work(payload: bytes) -> None:
        raise ValueError("bad \x00 value \ud800")

    async with Processor(app, store) as processor:
        delivery = MemoryDelivery(make_message(CH, b"{}", message_id="k"))
        await processor.process(CH, [delivery])
    outcome = delivery.settlements[-1]
    assert (outcome.action, outcome.reason) == (Action.DEAD_LETTER, Reason.MAX_ATTEMPTS)
    row = await db.fetchrow("SELECT status, attempts, error FROM dedupe_claims")
    assert (row["status"], row["attempts"]) == ("failed", 2)
    assert "bad \ufffd value \ufffd" in row["error"]
