"""The HTTP middleware's one-transaction claim in one round trip (one_transaction.claim):
BEGIN with its bounds and an EXECUTE of the session's prepared claim in one simple query, its
outcome read from the command's status; the completion fenced on the token the session drew
(SESSION_TOKEN: currval); the statements prepared once per session, and prepared again when
something deallocated them. Against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from dedupe.asgi import one_transaction as one_tx
from dedupe.claims.completion import SESSION_TOKEN, Completion, complete_and_commit
from dedupe.claims.database import HTTP_STATEMENTS, TransactionBounds, sql_value
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.claims.store import ClaimStore
from dedupe.errors import StoreError

BOUNDS = TransactionBounds.of(30.0)
SCOPE = "t.http/p"


class Counted:
    """A pooled connection whose round trips are counted (the calls that reach PostgreSQL)."""

    TRIPS = ("execute", "fetch", "fetchrow", "fetchval", "executemany")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.sent: list[str] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.conn, name)
        if name not in self.TRIPS:
            return found

        async def counted(query: str, *args: Any, **kwargs: Any) -> Any:
            self.sent.append(query)
            return await found(query, *args, **kwargs)

        return counted


def request(key: str, body: bytes = b"{}") -> ClaimRequest:
    return ClaimRequest(SCOPE, key, body.ljust(32, b"\0"))


@pytest.fixture
async def conn(store: ClaimStore) -> AsyncIterator[Any]:
    async with store.pool.acquire() as conn:
        yield conn


async def claim(store: ClaimStore, conn: Any, key: str) -> tuple[one_tx.Claimed, Counted]:
    counted = Counted(conn)
    db = one_tx.ClaimTransaction(store.pool, counted)
    found = await one_tx.claim(db, request(key), BOUNDS, owner="me", retention_s=3600)
    db.conn = None  # the fixture's connection: not released by this transaction
    return found, counted


async def test_a_new_key_is_claimed_in_one_round_trip_and_completed_in_another(
    store: ClaimStore, conn: Any, db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    claimed, counted = await claim(store, conn, "k")
    assert claimed == one_tx.Claimed(SESSION_TOKEN)
    assert len(counted.sent) == 1  # BEGIN, the bounds, the PREPAREs and the claim
    assert conn.is_in_transaction()
    assert await conn.fetchval("SHOW lock_timeout") == "0"  # lifted once the row is in
    token = await conn.fetchval("SELECT token FROM dedupe_claims WHERE key = 'k'")
    assert token == await conn.fetchval("SELECT currval('dedupe_claim_tokens')")
    await conn.execute("INSERT INTO effects VALUES ('k')")
    fence = Fence(SCOPE, "k", SESSION_TOKEN)
    assert await complete_and_commit(conn, Completion(fence, '{"n": 1}', 3600), reset="")
    assert not conn.is_in_transaction()
    stored = await db.fetchrow("SELECT status, token, result::text FROM dedupe_claims")
    assert (stored["status"], stored["token"], stored["result"]) == ("completed", token, '{"n": 1}')
    assert await db.fetchval("SELECT count(*) FROM effects") == 1
    # The next claim on the session sends its statement alone: they are prepared.
    again, counted = await claim(store, conn, "k2")
    assert again.token == SESSION_TOKEN
    assert counted.sent == [counted.sent[0]] and "PREPARE" not in counted.sent[0]
    await conn.execute("ROLLBACK")


async def test_the_claim_row_goes_in_as_it_commits_and_its_completion_is_a_hot_update(
    store: ClaimStore, conn: Any, db: asyncpg.Connection
) -> None:
    """The row is inserted completed, with no lease (no other transaction sees it before the
    COMMIT); the completion writes the response in without changing an indexed column's
    value, so PostgreSQL updates it in place (HOT), and the committed row is the completed key
    a two-commit run leaves."""
    await claim(store, conn, "k")
    row = await conn.fetchrow(
        "SELECT status, lease_until, result, attempts, expires_at - now() AS left"
        " FROM dedupe_claims WHERE key = 'k'"
    )
    assert (row["status"], row["lease_until"], row["result"], row["attempts"]) == (
        "completed",
        None,
        None,
        1,
    )
    assert row["left"].total_seconds() == 3600
    counts = (
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
        " WHERE relname = 'dedupe_claims'"
    )
    before = await conn.fetchrow(counts)
    await conn.execute(
        "EXECUTE dedupe_http_complete_v1($$t.http/p$$, 'k', NULL, '{\"n\": 1}', 3600.0)"
    )
    after = await conn.fetchrow(counts)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)  # one update, HOT
    await conn.execute("COMMIT")
    stored = await db.fetchrow(
        "SELECT status, lease_until, result::text, expires_at > now() + interval '59 minutes'"
        " AS kept FROM dedupe_claims"
    )
    assert tuple(stored) == ("completed", None, '{"n": 1}', True)


async def test_a_completion_fences_on_the_token_the_session_drew_last(
    store: ClaimStore, conn: Any, db: asyncpg.Connection
) -> None:
    """Should anything draw another token in the claim's session before its completion, the
    completion refuses: nothing is committed (not a double run: a 409 and a retry)."""
    claimed, _ = await claim(store, conn, "k")
    assert claimed.token == SESSION_TOKEN
    await conn.fetchval("SELECT nextval('dedupe_claim_tokens')")
    fence = Fence(SCOPE, "k", SESSION_TOKEN)
    assert await complete_and_commit(conn, Completion(fence, "1", 3600), reset="") is False
    assert conn.is_in_transaction()
    await conn.execute("ROLLBACK")
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 0


async def test_a_key_with_a_row_is_read_in_the_transaction(
    store: ClaimStore, conn: Any, db: asyncpg.Connection
) -> None:
    """INSERT 0 0: the key's row is read (a replay is answered from it), nothing written."""
    await claim(store, conn, "k")
    assert await complete_and_commit(
        conn, Completion(Fence(SCOPE, "k", SESSION_TOKEN), '"stored"', 3600), reset=""
    )
    found, counted = await claim(store, conn, "k")
    assert len(counted.sent) == 2  # the claim, then the read
    assert found == one_tx.Claimed(None, "completed", '"stored"', True) and found.replay
    await conn.execute("ROLLBACK")
    other = request("k", b"another body")
    db_tx = one_tx.ClaimTransaction(store.pool, conn)
    found = await one_tx.claim(db_tx, other, BOUNDS, owner="me", retention_s=3600)
    db_tx.conn = None
    assert found == one_tx.Claimed(None, "completed", '"stored"', False) and not found.replay
    await conn.execute("ROLLBACK")
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 1


@pytest.mark.parametrize("dropped", ["ALL", "dedupe_http_claim_v1"])
async def test_statements_deallocated_on_the_session_are_prepared_again_by_the_claim(
    store: ClaimStore, conn: Any, db: asyncpg.Connection, dropped: str
) -> None:
    """An endpoint's DEALLOCATE on request.state.idempotency.db (the session's statements no
    longer those it was marked with): the next claim prepares them again and claims. (The
    completion's alone: the claim does not see it, the completion fails, next test.)"""
    await claim(store, conn, "warm")
    await conn.execute("ROLLBACK")
    for key in ("k1", "k2"):  # twice on the session: its recovery uses no cached statement
        await conn.execute(f"DEALLOCATE {dropped}")
        claimed, counted = await claim(store, conn, key)
        assert claimed.token == SESSION_TOKEN
        assert any("PREPARE" in sent for sent in counted.sent)
        fence = Fence(SCOPE, key, SESSION_TOKEN)
        assert await complete_and_commit(conn, Completion(fence, "1", 3600), reset="")
        assert await db.fetchval("SELECT status FROM dedupe_claims WHERE key = $1", key) == (
            "completed"
        )
    names = await conn.fetch("SELECT name FROM pg_prepared_statements WHERE name LIKE 'dedupe%'")
    assert sorted(r["name"] for r in names) == sorted(HTTP_STATEMENTS)


async def test_a_completion_whose_statement_was_deallocated_fails_and_the_next_claim_works(
    store: ClaimStore, conn: Any, db: asyncpg.Connection
) -> None:
    """The endpoint deallocated the completion's statement in its own transaction: that run's
    completion fails (StoreError: the run answers 503 and gives its key back), nothing of it
    commits; the session's next claim prepares the statements again."""
    await claim(store, conn, "k")
    await conn.execute("DEALLOCATE dedupe_http_complete_v1")
    fence = Fence(SCOPE, "k", SESSION_TOKEN)
    with pytest.raises(StoreError, match="deallocated"):
        await complete_and_commit(conn, Completion(fence, "1", 3600), reset="")
    assert not conn.is_in_transaction()
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 0
    claimed, _ = await claim(store, conn, "k")
    assert claimed.token == SESSION_TOKEN
    assert await complete_and_commit(conn, Completion(fence, "1", 3600), reset="")
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "completed"


async def test_a_sessions_first_prepares_wait_no_longer_than_the_claims_lock_timeout(
    store: ClaimStore, conn: Any, db: asyncpg.Connection
) -> None:
    """A lock on the claims table (a CREATE INDEX, an ALTER): the PREPAREs sent with a
    session's first claim take it as the claim does, under the transaction's lock_timeout;
    once it is gone, the next claim prepares them (they did not run)."""
    await db.execute("BEGIN; LOCK TABLE dedupe_claims IN SHARE MODE")
    started = time.monotonic()
    async with asyncio.timeout(10):
        with pytest.raises(asyncpg.LockNotAvailableError):
            await claim(store, conn, "k")
    assert time.monotonic() - started < BOUNDS.lock_s + 1.5
    await conn.execute("ROLLBACK")
    await db.execute("ROLLBACK")
    claimed, _ = await claim(store, conn, "k")
    assert claimed.token == SESSION_TOKEN
    assert await complete_and_commit(
        conn, Completion(Fence(SCOPE, "k", SESSION_TOKEN), "1", 3600), reset=""
    )
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "completed"


@pytest.mark.parametrize(
    ("value", "read"),
    [
        (None, None),
        ("it's \\ $$ é \U0001f600", "it's \\ $$ é \U0001f600"),
        (b"\x00\xff'\\", b"\x00\xff'\\"),
        (2**62, 2**62),
        (-3, -3),
        (0.25, 0.25),
        (float("inf"), float("inf")),
    ],
)
async def test_a_simple_querys_value_reads_back_as_itself(conn: Any, value: Any, read: Any) -> None:
    kind = {
        type(None): "text",
        str: "text",
        bytes: "bytea",
        int: "bigint",
        float: "float8",
    }[type(value)]
    for conforming in ("on", "off"):
        await conn.execute(f"SET standard_conforming_strings = {conforming}")
        await conn.execute(f"PREPARE read_back ({kind}) AS SELECT $1")
        try:
            await conn.execute(f"CREATE TEMP TABLE out AS EXECUTE read_back({sql_value(value)})")
            assert await conn.fetchval("SELECT * FROM out") == read, conforming
        finally:
            await conn.execute("DROP TABLE IF EXISTS out; DEALLOCATE read_back")
    await conn.execute("RESET standard_conforming_strings")
    with pytest.raises(TypeError):
        sql_value(True)
