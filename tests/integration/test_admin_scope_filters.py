"""The admin commands' scope filter (`claims list --scope`, `claims purge --scope`) is a scope
and its tenants, literally: `_` and `%` in it are characters, not LIKE wildcards."""

from __future__ import annotations

import asyncpg

from dedupe.claims.store import ClaimStore
from dedupe.operations.claims import ClaimAdmin

# The filters, and for each one a scope that matches only if `_` or `%` were a wildcard.
FILTERS = {"shop_a.work": "shopXa.work", "pay%.work": "payments.work"}


async def insert_finished_claims(db: asyncpg.Connection, scopes: list[str]) -> None:
    """One completed claim per scope, last touched two days ago (old enough to purge)."""
    await db.executemany(
        """INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, claimed_at,
                                      updated_at, expires_at)
           VALUES ($1, 'k', '\\x00', 'completed', 'test', now() - interval '2 days',
                   now() - interval '2 days', now() + interval '1 day')""",
        [(scope,) for scope in scopes],
    )


async def test_claims_list_by_scope_takes_underscore_and_percent_literally(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A filter lists its own scope and tenants, never a scope matching it as a LIKE pattern."""
    scopes = [s for f, other in FILTERS.items() for s in (f, f"{f}/tenant", f"{other}/tenant")]
    await insert_finished_claims(db, scopes)
    for scope in FILTERS:
        listed = await store.list_claims(scope=scope)
        assert sorted(row["scope"] for row in listed) == [scope, f"{scope}/tenant"]


async def test_claims_purge_by_scope_leaves_scopes_that_only_match_as_a_like_pattern(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Purging a filter deletes its scope and tenants; the look-alike scopes keep their claims."""
    scopes = [s for f, other in FILTERS.items() for s in (f, f"{f}/tenant", f"{other}/tenant")]
    await insert_finished_claims(db, scopes)
    admin = ClaimAdmin(store)
    for scope in FILTERS:
        assert await admin.purge(older_than_s=3600, scope=scope) == 2
    left = await db.fetch("SELECT scope FROM dedupe_claims ORDER BY scope")
    assert [row["scope"] for row in left] == sorted(f"{o}/tenant" for o in FILTERS.values())
