"""A PostgreSQL URL listing several hosts, the first one dead: the store, the schema gate and
migrate reach the live one (asyncpg tries the hosts in turn, asking for a read-write session)."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from dedupe.claims.database import check_schema, connect_pool, migrate
from dedupe.claims.store import ClaimStore


def _dead_host_first(url: str) -> str:
    parts = urlsplit(url)
    creds, live = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{creds}@127.0.0.1:1,{live}"))


async def test_a_url_whose_first_host_is_dead_reaches_the_live_one(db_url: str) -> None:
    url = _dead_host_first(db_url)
    assert await migrate(url) == []  # migrated already, through the live host
    async with ClaimStore.open(url, owner="test") as store:
        await check_schema(store.pool, where=url)
        assert await store.pool.fetchval("SELECT NOT pg_is_in_recovery()")


TIMELINE = "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint"


async def test_tokens_start_at_the_timelines_floor_and_concurrent_connections_keep_them_unique(
    db_url: str,
) -> None:
    """Every new pooled connection moves the token sequence past (timeline << 40) once, under
    an advisory lock (a standby promoted after an asynchronous failover is a new timeline: no
    token the old primary issued can come again). Many connections opened at once while
    tokens are drawn never set the sequence back."""
    async with ClaimStore.open(db_url, owner="test", min_size=1, max_size=1) as store:
        timeline = await store.pool.fetchval(TIMELINE)
        floor = timeline << 40
        assert await store.pool.fetchval("SELECT last_value FROM dedupe_claim_tokens") >= floor
    # Put it behind the floor again (as a promoted standby's may be), then open 12 connections
    # at once while each draws tokens.
    async with ClaimStore.open(db_url, owner="test", min_size=1, max_size=1) as store:
        await store.pool.execute("SELECT setval('dedupe_claim_tokens', 5)")
    async with ClaimStore.open(db_url, owner="test", min_size=12, max_size=12) as store:

        async def draw() -> list[int]:
            async with store.pool.acquire() as conn:
                return [
                    await conn.fetchval("SELECT nextval('dedupe_claim_tokens')") for _ in range(50)
                ]

        drawn = [t for tokens in await asyncio.gather(*(draw() for _ in range(12))) for t in tokens]
    assert len(set(drawn)) == len(drawn) == 600
    assert min(drawn) > floor


async def test_a_session_that_may_not_move_the_sequence_connects_and_the_worker_log_says_so(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A session that cannot set the floor (read-only here; a role without UPDATE on the
    sequence alike): the connection is still used (a failover is rare, a worker that cannot
    start is not), and the worker's log says what is wrong and what to grant."""
    admin = await asyncpg.connect(db_url)
    try:
        await admin.execute("SELECT setval('dedupe_claim_tokens', 5)")
        read_only = f"{db_url}{'&' if '?' in db_url else '?'}default_transaction_read_only=on"
        with caplog.at_level(logging.WARNING, logger="dedupe.claims.database"):
            pool = await connect_pool(read_only, max_size=1)
            try:
                assert await pool.fetchval("SELECT 1") == 1
            finally:
                await pool.close()
        assert "could not move dedupe_claim_tokens" in caplog.text
        assert "read-only" in caplog.text
        assert await admin.fetchval("SELECT last_value FROM dedupe_claim_tokens") == 5
    finally:
        await admin.close()
