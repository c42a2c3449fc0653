"""The one fenced completion (dedupe.claims.completion) against a real PostgreSQL: a batch stores
the outbox rows of the claims it completed only, and a run's own transaction commits whole or
rolls back whole; the completion and its COMMIT in one round trip (the HTTP middleware's
one-transaction run) store any text and commit nothing past a refusing fence."""

from __future__ import annotations

import json

import asyncpg
import pytest

from dedupe.claims.completion import (
    Completion,
    complete_and_commit,
    complete_in,
    complete_in_transaction,
)
from dedupe.claims.database import literal
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.claims.store import ClaimStore
from dedupe.context import Database
from dedupe.effects.outbox import Outgoing
from dedupe.errors import StoreError


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


# -- the completion and the COMMIT in one round trip (complete_and_commit) --------------------

# Values that an SQL literal must carry unchanged: quotes, backslashes (an escape string's and
# a JSON text's), a dollar quote, a comment, a statement's end, non-ASCII and a 4-byte character.
HOSTILE = [
    "it's",
    "''; DROP TABLE effects; --",
    "back\\slash \\' \\\\ \\n",
    "$$ $x$ /* -- */ ;",
    "é ß 東京 \U0001f600",
]


async def test_a_literal_reads_back_as_its_text_whatever_standard_conforming_strings_says(
    db: asyncpg.Connection,
) -> None:
    for setting in ("on", "off"):
        await db.execute(f"SET standard_conforming_strings = {setting}")
        for text in HOSTILE:
            # (the setting in the text: asyncpg would reuse the statement parsed under the other)
            read = f"SELECT {literal(text)}::text /* {setting} */"
            assert await db.fetchval(read) == text, (setting, text)
            compare = f"SELECT {literal(text)} = $1::text /* {setting} */"
            assert await db.fetchval(compare, text) is True


@pytest.mark.parametrize("conforming", ["on", "off"])
async def test_complete_and_commit_stores_the_result_and_the_writes_in_one_commit(
    store: ClaimStore, db: asyncpg.Connection, conforming: str
) -> None:
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    result = json.dumps({"texts": HOSTILE, "nested": "\\\"'"}, ensure_ascii=False)
    key = "k'\\" + conforming
    fence = await claimed(store, key)
    async with store.pool.acquire() as conn:
        await conn.execute(f"SET standard_conforming_strings = {conforming}")
        await conn.execute("BEGIN")
        await conn.execute("INSERT INTO effects VALUES ($1)", key)
        done = await complete_and_commit(conn, Completion(fence, result, 3600, []), reset="")
        assert done is True
        assert not conn.is_in_transaction()
        await conn.execute("RESET standard_conforming_strings")
    stored = await db.fetchrow(
        "SELECT status, result::text, expires_at - now() AS left FROM dedupe_claims"
    )
    assert stored["status"] == "completed"
    assert json.loads(stored["result"]) == json.loads(result)
    assert 3500 < stored["left"].total_seconds() <= 3600
    assert await db.fetchval("SELECT array_agg(key) FROM effects") == [key]


async def test_complete_and_commit_refused_by_the_fence_commits_nothing(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Zero rows updated: False, the transaction aborted before its COMMIT (the run's writes
    are rolled back by the caller's ROLLBACK)."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    fence = await claimed(store, "k")
    stale = Fence(fence.scope, fence.key, fence.token + 1_000)
    async with store.pool.acquire() as conn:
        await conn.execute("BEGIN")
        await conn.execute("INSERT INTO effects VALUES ('k')")
        assert await complete_and_commit(conn, Completion(stale, "1", 3600, []), reset="") is False
        assert conn.is_in_transaction()
        await conn.execute("ROLLBACK")
    assert await db.fetchval("SELECT count(*) FROM effects") == 0
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "in_progress"


async def test_complete_and_commit_takes_no_outbox_rows(store: ClaimStore) -> None:
    fence = await claimed(store, "k")
    async with store.pool.acquire() as conn:
        with pytest.raises(ValueError, match="without outbox rows"):
            await complete_and_commit(conn, Completion(fence, "1", 3600, [row("k")]), reset="")


async def test_complete_and_commit_raises_what_the_commit_refused(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A deferred constraint the run's writes broke fails the COMMIT: raised as PostgreSQL said
    it; a deferred trigger's division by zero is not taken for the fence's (a StoreError)."""
    await db.execute(
        """
        CREATE TABLE effects (key text NOT NULL,
                              CONSTRAINT one UNIQUE (key) DEFERRABLE INITIALLY DEFERRED);
        CREATE FUNCTION divide() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN PERFORM 1 / 0; RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER divides AFTER INSERT ON effects DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW WHEN (NEW.key = 'divide') EXECUTE FUNCTION divide();
        """
    )
    for key, raised in (("twice", asyncpg.UniqueViolationError), ("divide", StoreError)):
        fence = await claimed(store, key)
        async with store.pool.acquire() as conn:
            await conn.execute("BEGIN")
            await conn.executemany(
                "INSERT INTO effects VALUES ($1)", [(key,), (key,)][: 2 if key == "twice" else 1]
            )
            with pytest.raises(raised):
                await complete_and_commit(conn, Completion(fence, "1", 3600, []), reset="")
            assert not conn.is_in_transaction()  # the failed COMMIT ended it
    assert await db.fetchval("SELECT count(*) FROM effects") == 0
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims WHERE status = 'completed'") == 0


async def test_complete_and_commit_runs_the_reset_after_the_commit(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The pool's reset goes after the COMMIT in the same round trip: a session setting the run
    made is gone, its completion committed."""
    fence = await claimed(store, "k")
    async with store.pool.acquire() as conn:
        await conn.execute("BEGIN")
        await conn.execute("SET application_name = 'changed by the run'")
        reset = conn.get_reset_query()
        assert reset
        assert await complete_and_commit(conn, Completion(fence, "1", 3600, []), reset=reset)
        assert await conn.fetchval("SHOW application_name") != "changed by the run"
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "completed"
