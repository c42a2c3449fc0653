"""The fenced completion: a run's result and retention recorded under its token, with its outbox
rows, in the transaction that holds its writes; a claim the fence refuses stores nothing.

Every completion in a run's own transaction goes through `complete_in`: the runner's (ctx.db),
the HTTP middleware's (the endpoint's db), a group commit's (one lane's transaction for all its
members) and the batch of runs whose only writes are publishes. The claims are updated first and
the outbox rows stored after, only for the claims that completed: in a batch of independent runs
a fenced one's rows must never be stored while the others commit, and where the transaction
holds one run's writes the order commits the same (a fenced run's transaction rolls back whole).
A group commit stores a member's rows in the member's savepoint as it finishes (a failed insert
is that member's failure, not the group's) and completes the group with rows already stored.
Durable steps are not part of it: each is recorded in its own statement as its function returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import asyncpg

from dedupe.claims.database import TRANSIENT_ERRORS, sql_value
from dedupe.claims.records import Fence, KeyId
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import storable_error
from dedupe.errors import StoreError
from dedupe.sql import queries


class OutboxRow(Protocol):
    """One message a run publishes, as the outbox stores it (dedupe.effects.outbox.Outgoing)."""

    @property
    def producer(self) -> str: ...
    @property
    def channel(self) -> str: ...
    @property
    def message_id(self) -> str: ...
    @property
    def body(self) -> bytes: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def content_type(self) -> str | None: ...


class Completion(NamedTuple):
    """A run's outcome to record: its claim's fence, its encoded result, how long the claim is
    kept, and the rows it publishes."""

    fence: Fence
    result: str  # JSON, made storable (dedupe.claims.values.encode_result)
    retention_s: float
    outbox: Sequence[OutboxRow] = ()


class HandlerTransaction(Protocol):
    """The transaction of a run's writes (dedupe.context.Database: ctx.db)."""

    async def connection(self) -> asyncpg.Connection: ...
    async def commit(self) -> None: ...
    async def close(self) -> None: ...


async def add_to_outbox(
    conn: asyncpg.Connection, rows: Sequence[OutboxRow], *, retention_s: float
) -> None:
    """Store publishes in `conn`'s transaction, in call order (driver errors as raised)."""
    if not rows:
        return
    await conn.execute(
        queries("outbox.sql")["add"],
        [r.producer for r in rows],
        [r.channel for r in rows],
        [r.message_id for r in rows],
        [r.body for r in rows],
        [json.dumps(r.headers) for r in rows],
        [r.content_type for r in rows],
        float(retention_s),
    )


async def complete_in(
    store: ClaimStore, conn: asyncpg.Connection, completions: Sequence[Completion]
) -> set[KeyId]:
    """Complete the claims fenced by their tokens in `conn`'s transaction, then store the outbox
    rows of those that completed; return the (scope, key) pairs completed."""
    done = await store.complete(
        [(c.fence, c.result, c.retention_s) for c in completions], conn=conn
    )
    # One statement per retention (a handler's option: usually one in all).
    by_retention: dict[float, list[OutboxRow]] = {}
    for c in completions:
        if c.outbox and c.fence.ident in done:
            by_retention.setdefault(c.retention_s, []).extend(c.outbox)
    try:
        for retention_s, rows in by_retention.items():
            await add_to_outbox(conn, rows, retention_s=retention_s)
    except (asyncpg.PostgresError, *TRANSIENT_ERRORS) as exc:
        raise StoreError(f"storing the run's publishes failed: {storable_error(exc)}") from exc
    return done


async def complete_in_transaction(
    store: ClaimStore, tx: HandlerTransaction, completion: Completion
) -> bool:
    """Complete one run in its own transaction and commit it; False when the fence refused it.
    The transaction is over when this returns or raises: committed, or rolled back whole.

    A COMMIT that fails is the store's failure (StoreError): whether it committed is unknown,
    and the claim settles it (a duplicate, or a take-over after the lease). A deferred
    constraint the run's writes broke is raised as PostgreSQL said it: the run's own error.
    """
    try:
        if not await complete_in(store, await tx.connection(), [completion]):
            return False
        try:
            await tx.commit()
        except asyncpg.IntegrityConstraintViolationError:
            raise
        except Exception as exc:
            raise StoreError(f"the commit failed: {storable_error(exc)}") from exc
        return True
    finally:
        await tx.close()  # rolls back what did not commit; a later use of ctx.db raises


# A fence's token that is not a number the claim read back, but "the token this session drew
# last" (currval): the HTTP middleware's one-transaction claim draws its token in the
# transaction's round trip that begins it, and does not read it (dedupe.asgi.one_transaction).
# The sequence's tokens start at 1: no claim holds this one.
SESSION_TOKEN = 0


async def complete_and_commit(
    conn: asyncpg.Connection, completion: Completion, *, reset: str
) -> bool:
    """Complete one run with no outbox rows and COMMIT `conn`'s open transaction, in one round
    trip (queries.sql, prepare_http_one_transaction: dedupe_http_complete_v1, prepared in the
    same query on a session that lacks it; `conn` is a StoreConnection); False when the fence
    refused it: nothing is committed and the transaction is left aborted, for the caller to
    roll back. A fence of SESSION_TOKEN is the token this session drew last. `reset`: the
    statements sent after the COMMIT (the pool's reset, or nothing). Raises as
    complete_in_transaction does: a deferred constraint the run's writes broke as PostgreSQL
    said it, any other failure as StoreError (whether it committed is unknown); ValueError for
    a completion with outbox rows. A statement that fails is logged by PostgreSQL with its
    text, values included (log_min_error_statement), as a parameter's value is not."""
    if completion.outbox:
        raise ValueError("complete_and_commit takes a completion without outbox rows")
    fence = completion.fence
    token = None if fence.token == SESSION_TOKEN else int(fence.token)
    values = (fence.scope, fence.key, token, completion.result, float(completion.retention_s))
    statement = f"EXECUTE dedupe_http_complete_v1({', '.join(map(sql_value, values))}); COMMIT"
    try:
        query = f"{conn.prepares()}{statement}"
        await conn.execute(f"{query}; {reset}" if reset else query)
    except asyncpg.DivisionByZeroError as exc:
        if conn.is_in_transaction():  # the SELECT's: no row completed, the COMMIT not reached
            return False
        # The COMMIT's (a deferred trigger of the run's writes): the run's own error.
        raise StoreError(f"the commit failed: {storable_error(exc)}") from exc
    except asyncpg.IntegrityConstraintViolationError:
        raise
    except asyncpg.InvalidSQLStatementNameError as exc:
        # Deallocated on this session since it was marked prepared (an endpoint's DISCARD ALL
        # or DEALLOCATE on request.state.idempotency.db): this run's transaction is lost; the
        # next claim on the connection prepares again.
        await conn.prepare_again()
        raise StoreError(f"the completion's statement was deallocated: {exc}") from exc
    except Exception as exc:
        raise StoreError(f"the completion or its commit failed: {storable_error(exc)}") from exc
    return True


__all__ = [
    "SESSION_TOKEN",
    "Completion",
    "HandlerTransaction",
    "OutboxRow",
    "add_to_outbox",
    "complete_and_commit",
    "complete_in",
    "complete_in_transaction",
]
