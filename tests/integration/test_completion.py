"""The one fenced completion (dedupe.claims.completion) against a real PostgreSQL: a batch stores
the outbox rows of the claims it completed only, and a run's own transaction commits whole or
rolls back whole."""

from __future__ import annotations

import asyncpg

from dedupe.claims.completion import Completion, complete_in, complete_in_transaction
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.claims.store import ClaimStore
from dedupe.context import Database
from dedupe.effects.outbox import Outgoing


async def claimed(store: ClaimStore, key: str) -> Fence:
    [claim] = await store.claim_batch(
        [ClaimRequest("t.work", key, key.encode().ljust(32, b"\0"))], lease_s=30, retention_s=3600
    )
    assert claim.token is not None
    return Fence("t.work", key, claim.token)


def row(key: str) -> Outgoing:
    return Outgoing(f"t.work\x1f{key}", "emails", f"{key}/0", b"{}", {}, None)


async def test_a_batch_stores_the_rows_of_the_claims_it_completed_and_not_a_zombies(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """One transaction for a batch: the fenced run's rows are left out, the others commit."""
    ours, other = await claimed(store, "ours"), await claimed(store, "zombie")
    zombie = Fence(other.scope, other.key, other.token + 1_000)  # a token the row does not hold
    async with store.pool.acquire() as conn, conn.transaction():
        done = await complete_in(
            store,
            conn,
            [Completion(ours, "1", 3600, [row("ours")]), Completion(zombie, "2", 3600, [row("z")])],
        )
    assert done == {("t.work", "ours")}
    assert await db.fetchval("SELECT array_agg(message_id) FROM dedupe_outbox") == ["ours/0"]


async def test_a_fenced_completion_in_a_runs_transaction_rolls_back_its_writes(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Zero rows updated: the run's writes and rows roll back, and ctx.db is closed."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    fence = await claimed(store, "k")
    tx = Database(store.pool)
    await tx.execute("INSERT INTO effects VALUES ('k')")
    stale = Fence(fence.scope, fence.key, fence.token + 1_000)
    completion = Completion(stale, "1", 3600, [row("k")])
    assert await complete_in_transaction(store, tx, completion) is False
    assert await db.fetchval("SELECT count(*) FROM effects") == 0
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 0
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "in_progress"
    assert not tx.started


async def test_a_completion_in_a_runs_transaction_commits_its_writes_and_rows_together(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Ours: the result, the writes and the rows commit in one transaction."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    fence = await claimed(store, "k")
    tx = Database(store.pool)
    await tx.execute("INSERT INTO effects VALUES ('k')")
    assert await complete_in_transaction(store, tx, Completion(fence, "1", 3600, [row("k")]))
    assert await db.fetchval("SELECT count(*) FROM effects") == 1
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 1
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "completed"
    assert not tx.started
