"""The claim store: the claim protocol's statements on PostgreSQL through asyncpg."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
from tenacity import wait_exponential_jitter

from dedupe.claims.database import (
    GC_LOCK_ID,
    TRANSIENT_ERRORS,
    VALUE_ERRORS,
    TransactionBounds,
    connect_pool,
    said,
    scheduled_wait,
)
from dedupe.claims.records import Claim, ClaimRequest, Fence, KeyId, Reason
from dedupe.claims.values import dropped_result, storable_text
from dedupe.errors import StoreError
from dedupe.sql import queries

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A statement of its own is sent at most this many times, after transient errors, waiting
# _FETCH_BACKOFF (tenacity's exponential backoff with jitter) after each failed one.
FETCH_ATTEMPTS = 4
_FETCH_BACKOFF = wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.05)

# A young claims table: PostgreSQL keeps one generic plan per prepared statement, and one made
# while the table held a few hundred rows reads the whole table (a hash join over a seq scan)
# for every claim until something invalidates it; autovacuum's first ANALYZE may be a minute
# away, and a worker fed a backlog meanwhile scans a growing table twice per statement. Every
# PLANS_CHECK_EVERY keys it claims, while the table's statistics count fewer than YOUNG_ROWS
# rows, the store looks, and analyzes a table that holds PLANS_MIN_ROWS rows or more and
# twice what its statistics count: the plans are made again from the table as it is (nested
# loops over the primary key from a few thousand rows on), and autovacuum takes over from
# YOUNG_ROWS on.
PLANS_CHECK_EVERY = 500
PLANS_MIN_ROWS = 1000
YOUNG_ROWS = 10_000


def fetch_backoff(failed: int) -> float:
    """The wait after failed attempt number `failed`, as tenacity's wait computes it."""
    return scheduled_wait(_FETCH_BACKOFF, failed)


class ValueRefused(StoreError):
    """PostgreSQL refused a value of the statement (not the connection, not the statement)."""


def _outcome_columns(outcomes: Sequence[tuple[Fence, str, float]]) -> tuple[list[Any], ...]:
    """(fence, result, retention_s) outcomes as the completion statements' five arrays."""
    return (
        [f.scope for f, _, _ in outcomes],
        [f.key for f, _, _ in outcomes],
        [f.token for f, _, _ in outcomes],
        [result for _, result, _ in outcomes],
        [float(retention_s) for _, _, retention_s in outcomes],
    )


class ClaimStore:
    """Claims, leases, outcomes and clean-up on one asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool, *, owner: str) -> None:
        self.pool = pool
        self.owner = owner
        self._q = queries()
        self._claimed_since_check = 0
        self._plans_checked = False  # past YOUNG_ROWS as last analyzed, or not ours to analyze
        self._plans: asyncio.Task[None] | None = None

    @classmethod
    @asynccontextmanager
    async def open(
        cls, dsn: str, *, owner: str, min_size: int = 1, max_size: int = 10
    ) -> AsyncIterator[ClaimStore]:
        """Connect a pool, yield a store, close the pool on exit."""
        pool = await connect_pool(dsn, min_size=min_size, max_size=max_size)
        store: ClaimStore | None = None
        try:
            store = cls(pool, owner=owner)
            yield store
        finally:
            if store is not None:
                await store.stop_looking()
            await pool.close()

    # -- helpers -----------------------------------------------------------------------

    async def _fetch(
        self, name: str, *args: Any, conn: Any = None, bounded: str | None = None
    ) -> list[asyncpg.Record]:
        """Run statement `name`; `bounded`: in a transaction of its own that these SET LOCAL
        settings bound (lock_timeout...), whose asyncpg.LockNotAvailableError is raised as
        it comes."""
        try:
            if conn is not None:
                return list(await conn.fetch(self._q[name], *args))
            # A statement of its own is sent again after a transient error, on another pooled
            # connection. Every statement here is safe to repeat: a repeated claim finds its own
            # claims by its request id, a repeated completion or failure finds our own outcome,
            # a repeated attempt count or give-back finds the count it made. tenacity's schedule
            # (FETCH_ATTEMPTS, fetch_backoff) without an AsyncRetrying per call, whose set-up
            # and iteration cost more than the rest of this method: a retry is rare, a first
            # attempt is not.
            failed = 0
            while True:
                try:
                    async with self.pool.acquire() as pooled:
                        if bounded is None:
                            rows = list(await pooled.fetch(self._q[name], *args))
                        else:
                            async with pooled.transaction():
                                await pooled.execute(bounded)
                                rows = list(await pooled.fetch(self._q[name], *args))
                        pooled.mark_clean()  # SET LOCAL ended with the transaction
                        return rows
                except TRANSIENT_ERRORS:
                    failed += 1
                    # A closed pool stays closed (a stop dropped it past its bound): trying
                    # again only slows every give-back of the stop by the backoff.
                    if failed >= FETCH_ATTEMPTS or self.pool.is_closing():
                        raise
                await asyncio.sleep(fetch_backoff(failed))
        except asyncpg.LockNotAvailableError:
            raise
        except TRANSIENT_ERRORS as exc:
            raise StoreError(f"{name} failed: {exc.__class__.__name__}: {exc}") from exc
        except VALUE_ERRORS as exc:
            raise ValueRefused(f"{name}: PostgreSQL refused a value: {said(exc)}") from exc
        except asyncpg.PostgresError as exc:
            raise StoreError(f"{name} was refused by PostgreSQL: {exc}") from exc

    async def _each(
        self, items: Sequence[T], send: Callable[[Sequence[T]], Awaitable[list[asyncpg.Record]]]
    ) -> tuple[list[asyncpg.Record], list[tuple[T, str]]]:
        """Send a batched statement; where PostgreSQL refuses a value, split the batch in halves
        until only the items carrying it are left out. Returns the rows and the refused items
        with the reason; any other error fails the whole batch."""
        try:
            return await send(items), []
        except ValueRefused as exc:
            if len(items) == 1:
                return [], [(items[0], str(exc))]
            logger.warning("PostgreSQL refused a value in a batch of %d; splitting it", len(items))
        middle = len(items) // 2
        rows, refused = await self._each(items[:middle], send)
        more_rows, more_refused = await self._each(items[middle:], send)
        return rows + more_rows, refused + more_refused

    # -- the claim protocol ----------------------------------------------------------

    async def claim_batch(
        self, requests: Sequence[ClaimRequest], *, lease_s: float, retention_s: float
    ) -> list[Claim]:
        """Claim every key in one statement; keys must be distinct within the batch.

        A request whose values PostgreSQL refuses comes back `refused`, the others claimed as
        usual (the batch is split around it).
        """
        if not requests:
            return []
        request_id = secrets.randbits(63)

        async def send(batch: Sequence[ClaimRequest]) -> list[asyncpg.Record]:
            return await self._fetch(
                "claim_batch",
                [r.scope for r in batch],
                [r.key for r in batch],
                [r.payload_hash for r in batch],
                self.owner,
                float(lease_s),
                float(retention_s),
                request_id,
                _column(r.fingerprint for r in batch),
                _column(r.raw_hash for r in batch),
                _column(r.payload for r in batch),
            )

        rows, refused = await self._each(requests, send)
        self.count_claims(len(requests))
        by_key = {KeyId(row["scope"], row["key"]): _claim_of(row) for row in rows}
        for request, why in refused:
            by_key[request.ident] = Claim(
                scope=request.scope, key=request.key, token=None, attempts=0, refused=why
            )
        return [by_key[r.ident] for r in requests]

    async def claim_in(
        self,
        conn: asyncpg.Connection,
        request: ClaimRequest,
        *,
        lease_s: float,
        retention_s: float,
    ) -> int | None:
        """One-transaction mode: claim a key that has no row, inside `conn`'s open transaction;
        the token, or None when the key has a row (committed by then: a row another
        transaction has not committed is waited for, within its lock_timeout). Driver errors
        are raised as they come (the caller's transaction is over either way)."""
        token = await conn.fetchval(
            self._q["claim_one_transaction"],
            *request.row(self.owner),
            float(lease_s),
            float(retention_s),
            secrets.randbits(63),
        )
        self.count_claims(1)
        return None if token is None else int(token)

    # -- the plans of a young table ----------------------------------------------------

    def count_claims(self, keys: int) -> None:
        """Keys claimed: every PLANS_CHECK_EVERY of them, look at the table's statistics (the
        HTTP middleware counts its one-transaction claims here too)."""
        if self._plans_checked:
            return
        self._claimed_since_check += keys
        if self._claimed_since_check >= PLANS_CHECK_EVERY and (
            self._plans is None or self._plans.done()
        ):
            self._claimed_since_check = 0
            self._plans = asyncio.create_task(self._analyze_if_young(), name="dedupe-plans")

    async def stop_looking(self) -> None:
        """Cancel a look at the table's statistics under way (before the pool closes)."""
        task, self._plans = self._plans, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _analyze_if_young(self) -> None:
        """ANALYZE the claims table if it holds PLANS_MIN_ROWS rows or more and twice what its
        statistics count (never analyzed, or analyzed while small); never raises."""
        try:
            async with self.pool.acquire() as conn:
                row = await conn.fetchrow(self._q["young_table"])
                conn.mark_clean()  # a read: no session state to reset
                if row is None or row["analyzed_rows"] >= YOUNG_ROWS or not row["may_analyze"]:
                    self._plans_checked = True  # grown, or not ours to analyze: never again
                    return
                analyzed = max(int(row["analyzed_rows"]), 0)
                if row["live_rows"] < max(PLANS_MIN_ROWS, 2 * analyzed):
                    return  # (a table that stays small: one cheap read per PLANS_CHECK_EVERY)
                async with conn.transaction():
                    # Behind a vacuum of the table, give up rather than hold a pooled
                    # connection: autovacuum analyzes it then.
                    await conn.execute("SET LOCAL lock_timeout = '1s'")
                    await conn.execute("ANALYZE dedupe_claims")
                conn.mark_clean()  # SET LOCAL ended with the transaction
                logger.info(
                    "analyzed dedupe_claims (%d rows; %d when last analyzed): the claim "
                    "statements are planned again for a table of this size",
                    row["live_rows"],
                    analyzed,
                )
        except Exception as exc:  # a statistics read is never worth failing a claim for
            logger.debug("checking the claims table's statistics failed: %s", exc)

    async def first_attempt_failed(
        self,
        request: ClaimRequest,
        *,
        retention_s: float,
        bounds: TransactionBounds | None = None,
    ) -> bool:
        """One-transaction mode: commit the count of a first attempt whose transaction rolled
        back (a claim with attempts = 1, its lease over, handed back); False when the key has
        a row already (claimed meanwhile by another delivery, whose outcome decides).

        A row another transaction has not committed yet (a competing request's claim, its run
        still open) is waited for; with `bounds`, in a transaction begun as the one-transaction
        claim's is, at most `bounds.lock_s`: past it asyncpg.LockNotAvailableError is raised
        (the key is held by a run still open, as for that claim)."""
        args = (*request.row(self.owner), float(retention_s))
        bounded = None if bounds is None else bounds.settings()
        rows = await self._fetch("first_attempt_failed", *args, bounded=bounded)
        return bool(rows)

    async def warm_up(self, connections: int, *, timeout_s: float = 5.0) -> None:
        """Open up to `connections` pooled connections (never more than the pool holds) and
        plan the hot statements on each: each runs once with no rows (nothing is claimed or
        changed), so the first messages after a start do not wait for connects and planning.
        Best effort, bounded by `timeout_s`: a failure is logged and the start goes on."""
        count = min(max(0, connections), self.pool.get_max_size())

        async def warm(stack: contextlib.AsyncExitStack) -> None:
            # Each connection is registered as soon as it is acquired, so a cancellation or a
            # failure releases every one already taken.
            conn = await stack.enter_async_context(self.pool.acquire())
            await conn.fetch(self._q["claim_batch"], [], [], [], "", 1.0, 1.0, 0, [], [], [])
            await conn.fetch(self._q["complete"], [], [], [], [], [])
            await conn.fetch(self._q["heartbeat"], [], [], [], [])
            conn.mark_clean()  # no session state to reset

        try:
            async with asyncio.timeout(timeout_s), contextlib.AsyncExitStack() as stack:
                # All of them end before the stack releases what they took.
                results = await asyncio.gather(
                    *(warm(stack) for _ in range(count)), return_exceptions=True
                )
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    raise failed[0]
        except Exception as exc:  # never fails the start: the first claims connect instead
            logger.warning("warming up the claims pool failed (%r); going on without", exc)

    async def heartbeat(self, leases: Sequence[tuple[Fence, float]]) -> set[KeyId]:
        """Extend leases; return the (scope, key) pairs that are still ours.

        A lease whose values PostgreSQL refuses counts as ours (its fence still guards the
        completion); the others are extended as usual.
        """
        if not leases:
            return set()

        async def send(batch: Sequence[tuple[Fence, float]]) -> list[asyncpg.Record]:
            return await self._fetch(
                "heartbeat",
                [f.scope for f, _ in batch],
                [f.key for f, _ in batch],
                [f.token for f, _ in batch],
                [float(lease_s) for _, lease_s in batch],
            )

        rows, refused = await self._each(leases, send)
        for (fence, _), why in refused:
            logger.warning("heartbeat of %s/%s refused: %s", fence.scope, fence.key, why)
        return {KeyId(row["scope"], row["key"]) for row in rows} | {
            fence.ident for (fence, _), _ in refused
        }

    async def complete(
        self,
        outcomes: Sequence[tuple[Fence, str, float]],
        *,
        conn: asyncpg.Connection | None = None,
    ) -> set[KeyId]:
        """Record (fence, result_json, retention_s) outcomes; return the keys completed.

        On its own connection, a result PostgreSQL refuses is stored as a marker saying why
        (dedupe.claims.values.dropped_result) and the batch's other outcomes are recorded as usual.
        Inside a handler's transaction (`conn`) nothing can be split: results are made
        storable before they get here (dedupe.claims.values.encode_result).
        """
        if not outcomes:
            return set()

        async def send(batch: Sequence[tuple[Fence, str, float]]) -> list[asyncpg.Record]:
            return await self._fetch("complete", *_outcome_columns(batch), conn=conn)

        if conn is not None and len(outcomes) == 1:
            [(fence, result, retention_s)] = outcomes
            rows = await self._fetch(
                "complete_one",
                fence.scope,
                fence.key,
                fence.token,
                result,
                float(retention_s),
                conn=conn,
            )
        elif conn is not None:
            rows = await send(outcomes)
        else:
            rows, refused = await self._each(outcomes, send)
            for (fence, _, retention_s), why in refused:
                logger.warning(
                    "the result of %s/%s was refused (%s); storing a marker instead",
                    fence.scope,
                    fence.key,
                    why,
                    extra={"scope": fence.scope, "key": fence.key},
                )
                marker = dropped_result(f"PostgreSQL refused the result: {why}")
                with contextlib.suppress(ValueRefused):
                    rows += await send([(fence, marker, retention_s)])
        return {KeyId(row["scope"], row["key"]) for row in rows}

    async def complete_unlocked(
        self, outcomes: Sequence[tuple[Fence, str, float]]
    ) -> tuple[set[Fence], set[Fence]]:
        """`complete` on its own connection, for callers that must not wait for each other:
        return the claims completed and the claims skipped because another transaction holds
        their row locked (the caller completes those alone). Claims, not keys: a lapsed
        claim's outcome beside its new owner's in one statement is told apart by its token.
        An outcome PostgreSQL refuses is counted as skipped, for `complete` to store its
        marker."""
        if not outcomes:
            return set(), set()

        async def send(batch: Sequence[tuple[Fence, str, float]]) -> list[asyncpg.Record]:
            return await self._fetch("complete_unlocked", *_outcome_columns(batch))

        rows, refused = await self._each(outcomes, send)
        done = {Fence(r["scope"], r["key"], r["token"]) for r in rows if r["completed"]}
        skipped = {Fence(r["scope"], r["key"], r["token"]) for r in rows if not r["completed"]}
        skipped.update(fence for (fence, _, _), _ in refused)
        return done, skipped

    async def record_attempt(
        self, fence: Fence, *, attempt: int, error: str | None, lease_s: float
    ) -> int | None:
        """Count attempt number `attempt` (the one about to run); None when the key is no
        longer ours. Sent again after a lost reply, it counts nothing more."""
        rows = await self._fetch(
            "record_attempt",
            fence.scope,
            fence.key,
            fence.token,
            None if error is None else storable_text(error, 1000),
            float(lease_s),
            attempt,
        )
        return int(rows[0]["attempts"]) if rows else None

    async def fail(self, fence: Fence, *, reason: Reason, detail: str, retention_s: float) -> bool:
        """Mark the key failed for good, for `reason` (its own column) with `detail`; False when
        it was no longer ours."""
        rows = await self._fetch(
            "fail",
            fence.scope,
            fence.key,
            fence.token,
            Reason(reason).value,
            storable_text(detail, 1000),
            float(retention_s),
        )
        return bool(rows)

    async def mark_dead_lettered(self, fences: Sequence[Fence]) -> None:
        """Record that the dead letters of these failed claims were confirmed (fenced by the
        token of the failure, so a newer claim's failure keeps its own record)."""
        if not fences:
            return

        async def send(batch: Sequence[Fence]) -> list[asyncpg.Record]:
            return await self._fetch(
                "mark_dead_lettered",
                [f.scope for f in batch],
                [f.key for f in batch],
                [f.token for f in batch],
            )

        await self._each(fences, send)

    async def give_back(
        self, fence: Fence, *, attempt: int | None = None, handed_back: bool = True
    ) -> bool:
        """Release our lease at once (graceful shutdown). `attempt`: the count the interrupted
        run made, taken back (None: it was not counted; sent again after a lost reply, nothing
        more is taken back). `handed_back` marks the key as given back (its next run need not
        wait alone as a dead worker's key does); False (a dead worker's key this worker took
        over) marks it 'handed back after a take-over', which keeps the crash in its history.
        A heartbeat extends neither."""
        rows = await self._fetch(
            "give_back",
            fence.scope,
            fence.key,
            fence.token,
            attempt is not None,
            handed_back,
            attempt or 0,
        )
        return bool(rows)

    # -- operations ----------------------------------------------------------------------

    async def release(self, scope: str, key: str) -> str | None:
        """Make a stuck or failed key claimable again; return its status, None if not found."""
        rows = await self._fetch("release", scope, key)
        return str(rows[0]["status"]) if rows else None

    async def release_failed(self, scope: str, key: str) -> bool:
        """Make a failed key claimable again (never one in progress); whether it was failed."""
        return bool(await self._fetch("release_failed", scope, key))

    async def gc(self, *, batch_size: int = 1000, max_batches: int = 100) -> Cleaned | None:
        """Delete expired claims, then sent outbox rows past their retention, in batches (at
        most `max_batches` of each) under the one clean-up lock; None if another holds it."""
        outbox_gc = queries("outbox.sql")["gc"]
        try:
            async with self.pool.acquire() as conn:
                if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", GC_LOCK_ID):
                    return None
                try:
                    claims = await _in_batches(conn, self._q["gc_batch"], batch_size, max_batches)
                    outbox = await _in_batches(conn, outbox_gc, batch_size, max_batches)
                finally:
                    await conn.execute("SELECT pg_advisory_unlock($1)", GC_LOCK_ID)
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
            raise StoreError(f"clean-up failed: {exc}") from exc
        return Cleaned(claims=claims, outbox=outbox)

    async def list_claims(
        self,
        *,
        scope: str | None = None,
        status: str | None = None,
        older_than_s: float | None = None,
        limit: int = 50,
    ) -> list[dict[str, Any]]:
        rows = await self._fetch("list_claims", scope, status, older_than_s, limit)
        return [dict(row) for row in rows]

    async def show_claim(self, scope: str, key: str) -> dict[str, Any] | None:
        rows = await self._fetch("show_claim", scope, key)
        return dict(rows[0]) if rows else None


@dataclass(frozen=True, slots=True)
class Cleaned:
    """What one clean-up deleted: expired claims (their events, steps and conflicts go with
    them) and sent outbox rows past their retention."""

    claims: int
    outbox: int


async def _in_batches(conn: asyncpg.Connection, statement: str, size: int, most: int) -> int:
    """Run a DELETE of at most `size` rows until it deletes fewer, `most` times at most."""
    deleted = 0
    for _ in range(most):
        count = int((await conn.execute(statement, size)).split()[-1])
        deleted += count
        if count < size:
            break
    return deleted


def _column(values: Iterable[T | None]) -> list[T | None] | None:
    """An array parameter, or NULL when every value is: a batch of raw payloads without kept
    bytes sends no arrays of NULLs (unnest pads a NULL array with NULLs, row for row)."""
    column = list(values)
    return column if any(v is not None for v in column) else None


def _claim_of(row: asyncpg.Record) -> Claim:
    token = row["token"]
    handed_back = bool(row["handed_back"])
    return Claim(
        scope=row["scope"],
        key=row["key"],
        token=token,
        attempts=row["attempts"] or row["existing_attempts"] or 0,
        # Re-claimed (not inserted): a lapsed lease of a dead worker, unless it was handed
        # back. A claim of ours found again by a repeated statement is counted as new.
        taken_over=token is not None and row["inserted"] is False and not handed_back,
        handed_back=handed_back,
        status=row["status"],
        same_payload=row["same_payload"],
        lease_live=row["lease_live"],
        result=row["result"],
        reason=row["reason"],
        error=row["error"],
        dead_lettered=row["dead_lettered"],
        row_token=row["row_token"],
        row_fingerprint=row["row_fingerprint"],
        row_hash=row["row_hash"],
        row_payload=row["row_payload"],
    )


__all__ = ["ClaimStore", "Cleaned", "ValueRefused"]
