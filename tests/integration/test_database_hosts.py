"""A PostgreSQL URL listing several hosts, the first one dead: the store, the schema gate and
migrate reach the live one (asyncpg tries the hosts in turn, asking for a read-write session)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from dedupe.claims.database import check_schema, migrate
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
