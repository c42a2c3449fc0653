"""Outbox clean-up belongs to the one clean-up leader (the lock the claims' clean-up takes) and
to `dedupe-worker gc`; its lag shows in the metrics; against a real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg

from dedupe import App, Context
from dedupe.claims.database import GC_LOCK_ID
from dedupe.claims.store import ClaimStore, Cleaned
from dedupe.observability.metrics import Metrics
from dedupe.pipeline.processor import Processor
from tests.conftest import eventually

# Two sent rows past their retention (to delete), one sent row still kept, one unsent row past
# its expiry (never deleted: still to relay; due only in an hour, so no relay takes it).
ROWS = """
INSERT INTO dedupe_outbox (producer, channel, message_id, body, sent_at, expires_at, next_try_at)
VALUES ('p\x1fa', 'cleanup-test', 'old-1', 'x', now() - interval '2 days',
        now() - interval '1 day', now()),
       ('p\x1fb', 'cleanup-test', 'old-2', 'x', now() - interval '2 days',
        now() - interval '2 hours', now()),
       ('p\x1fc', 'cleanup-test', 'kept', 'x', now(), now() + interval '1 day', now()),
       ('p\x1fd', 'cleanup-test', 'unsent', 'x', NULL, now() - interval '1 day',
        now() + interval '1 hour')
"""
LEFT = "SELECT message_id FROM dedupe_outbox ORDER BY message_id"


def quiet_app() -> App:
    app = App("cleanup")

    @app.handler("cleanup-test-in")
    async def work(payload: dict[str, object], ctx: Context) -> None:
        pass

    return app


async def left(db: asyncpg.Connection) -> list[str]:
    return [r["message_id"] for r in await db.fetch(LEFT)]


async def test_gc_deletes_sent_rows_past_their_retention_and_keeps_unsent_ones(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """One clean-up deletes the sent rows whose retention ended, never an unsent one."""
    await db.execute(ROWS)
    assert await store.gc(batch_size=1) == Cleaned(claims=0, outbox=2)
    assert await left(db) == ["kept", "unsent"]


async def test_only_the_clean_up_leader_cleans_the_outbox(
    store: ClaimStore, db: asyncpg.Connection, db_url: str
) -> None:
    """A worker whose clean-up finds another leader (the lock held elsewhere) leaves the
    outbox alone; once the lock is free, its next round cleans it."""
    await db.execute(ROWS)
    leader = await asyncpg.connect(db_url)
    try:
        assert await leader.fetchval("SELECT pg_try_advisory_lock($1)", GC_LOCK_ID)
        async with Processor(quiet_app(), store, gc_interval_s=0.05) as processor:
            await asyncio.sleep(0.6)  # a dozen rounds, each finding the leader elsewhere
            assert len(await left(db)) == 4
            await leader.execute("SELECT pg_advisory_unlock($1)", GC_LOCK_ID)

            async def cleaned() -> bool:
                return await left(db) == ["kept", "unsent"]

            async def counted() -> int:
                # The rows are gone at the clean-up's DELETE; its count is added after the lock's
                # release and the pool's reset, round trips later (longer on a busy machine).
                return processor.stats.outbox_gc_deleted

            await eventually(cleaned, timeout_s=10)
            await eventually(counted, timeout_s=10)
            assert processor.stats.outbox_gc_deleted == 2
    finally:
        await leader.close()


async def test_the_outbox_clean_up_lag_is_a_gauge(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """How long the oldest sent row past its retention has waited (a day here), 0 once gone;
    the unsent rows and the oldest one's age beside it."""
    metrics = Metrics()
    await metrics.check_claims(store)
    assert metrics.registry.get_sample_value("dedupe_outbox_cleanup_lag_seconds") == 0
    await db.execute(ROWS)
    await metrics.check_claims(store)
    lag = metrics.registry.get_sample_value("dedupe_outbox_cleanup_lag_seconds")
    assert lag is not None and 86_399 < lag < 86_500
    assert metrics.registry.get_sample_value("dedupe_outbox_unsent") == 1
    oldest = metrics.registry.get_sample_value("dedupe_outbox_oldest_unsent_seconds")
    assert oldest is not None and oldest >= 0
    await store.gc()
    await metrics.check_claims(store)
    assert metrics.registry.get_sample_value("dedupe_outbox_cleanup_lag_seconds") == 0
