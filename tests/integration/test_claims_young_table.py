"""A young claims table is analyzed by the store as it grows, so the claim statements' cached
plans stop reading the whole table (dedupe.claims.store, PLANS_MIN_ROWS, YOUNG_ROWS)."""

from __future__ import annotations

import asyncio
import hashlib
import time

import asyncpg
import pytest

from dedupe.claims import store as store_module
from dedupe.claims.records import ClaimRequest
from dedupe.claims.store import ClaimStore


def requests(start: int, count: int) -> list[ClaimRequest]:
    return [
        ClaimRequest("t.young", f"k{i}", hashlib.sha256(b"%d" % i).digest())
        for i in range(start, start + count)
    ]


async def table_state(db: asyncpg.Connection) -> tuple[float, bool]:
    row = await db.fetchrow(
        "SELECT c.reltuples, s.last_analyze IS NOT NULL AS analyzed FROM pg_class c"
        " JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = 'dedupe_claims'::regclass"
    )
    assert row is not None
    return float(row["reltuples"]), bool(row["analyzed"])


async def claim_until_analyzed(store: ClaimStore, db: asyncpg.Connection, *, most: int) -> int:
    """Claim batches of 100 new keys until the table is analyzed (at most `most` keys, 20 s):
    a busy backend reports its rows to the statistics about once a second."""
    claimed = 0
    deadline = time.monotonic() + 20
    while claimed < most and time.monotonic() < deadline:
        await store.claim_batch(requests(claimed, 100), lease_s=30, retention_s=3600)
        claimed += 100
        await asyncio.sleep(0.05)
        if (await table_state(db))[1]:
            return claimed
    return claimed


async def small_table_rules(
    monkeypatch: pytest.MonkeyPatch, db: asyncpg.Connection, *, every: int, rows: int
) -> None:
    """Look every `every` keys, analyze from `rows` rows and stop there; no autovacuum on the
    table (its ANALYZE may come at any moment on a new table: the test wants the store's)."""
    monkeypatch.setattr(store_module, "PLANS_CHECK_EVERY", every)
    monkeypatch.setattr(store_module, "PLANS_MIN_ROWS", rows)
    monkeypatch.setattr(store_module, "YOUNG_ROWS", rows)
    await db.execute("ALTER TABLE dedupe_claims SET (autovacuum_enabled = false)")


async def test_a_young_claims_table_is_analyzed_once_it_holds_enough_rows(
    store: ClaimStore, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    await small_table_rules(monkeypatch, db, every=100, rows=1000)
    before, analyzed = await table_state(db)
    assert not analyzed and before < 1000
    claimed = await claim_until_analyzed(store, db, most=40_000)
    reltuples, analyzed = await table_state(db)
    assert analyzed, f"not analyzed after {claimed} claims"
    assert reltuples >= 1000  # the plans are made again from the table as it is


async def test_a_table_analyzed_at_its_size_is_not_analyzed_again(
    store: ClaimStore, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment's table (its statistics current) costs one look, then nothing."""
    await small_table_rules(monkeypatch, db, every=100, rows=1000)
    await db.execute(
        "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, expires_at)"
        " SELECT 'old', 'k' || g, '\\x00', 'completed', 'o', now() + interval '1 day'"
        " FROM generate_series(1, 2000) g"
    )
    await db.execute("ANALYZE dedupe_claims")
    first = await db.fetchval(
        "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'dedupe_claims'"
    )
    for start in range(0, 1000, 100):
        await store.claim_batch(requests(start, 100), lease_s=30, retention_s=3600)
    await asyncio.sleep(0.2)
    assert store._plans_checked
    assert (
        await db.fetchval(
            "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'dedupe_claims'"
        )
        == first
    )


async def test_the_middlewares_one_transaction_claims_count_too(
    orders_db: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IdempotencyMiddleware(one_transaction=True) claims new keys outside claim_batch: its
    claims count as well, and its young table is analyzed."""
    from tests.apps.http_api import create_test_api
    from tests.integration.http_server import serving
    from tests.integration.test_http_api import client_of, post

    await small_table_rules(monkeypatch, db, every=20, rows=200)
    async with (
        serving(create_test_api(orders_db, one_transaction=True)) as base,
        client_of(base) as client,
    ):
        deadline = time.monotonic() + 20
        sent = 0
        while time.monotonic() < deadline and sent < 5000:
            answers = await asyncio.gather(
                *(post(client, f"y-{sent + i}", {"sku": "book"}) for i in range(20))
            )
            assert {a.status_code for a in answers} == {201}
            sent += 20
            if (await table_state(db))[1]:
                break
            await asyncio.sleep(0.05)
    reltuples, analyzed = await table_state(db)
    assert analyzed, f"not analyzed after {sent} requests"
    assert reltuples >= 200
