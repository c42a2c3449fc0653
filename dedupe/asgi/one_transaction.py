"""One transaction per keyed request where one is enough (`one_transaction=`): the claim, the
endpoint's `request.state.idempotency.db` writes, its publishes and its stored response commit
together, on one pooled connection, in one COMMIT.

    BEGIN; SET LOCAL lock_timeout, idle_in_transaction_session_timeout, statement_timeout;
        INSERT the claim where the key has no row (attempts = 1), in one round trip
    (when the key has a row: read it)
    the endpoint, with request.state.idempotency.db on this transaction, under the bound
    the fenced completion with the response and the outbox rows; COMMIT (with the pool's reset),
        in the completion's round trip when nothing was published (complete_and_commit)
    then the response goes out

Only a key without any row is claimed here. A key with one has it read in the transaction, and
is answered from the read when it is a replay (completed, the same request); any other (a
conflict, a key in flight, one given back after a failed attempt) is left to the two-commit
claim, which decides as it always does. A concurrent duplicate meets the uncommitted row and
waits on it (its `lock_timeout`), then finds the key completed (a replay) or free (it runs);
past the wait it gets the 409 of a key in flight. Every answer that gives the key back (a 5xx,
an exception, a status not stored, the bound) rolls the whole transaction back, claim included,
then commits the attempt on its own (`first_attempt_failed`: a row handed back, its lease
over), so that the client's retry runs as attempt 2 on the two-commit path, under a lease,
without the bound. That commit is bounded like the claim (`lock_timeout`): a duplicate that
claimed the key meanwhile and still runs holds it, and its outcome decides; the attempt is then
not counted.
The argument why the guarantees hold is in docs/http-api.md, "One transaction per request".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from dedupe.asgi.problems import Problem
from dedupe.asgi.run import STORE_TIMEOUT_S, Held, KeyedRun, Receive, Scope
from dedupe.claims.batching import Batcher
from dedupe.claims.completion import SESSION_TOKEN, Completion, complete_and_commit
from dedupe.claims.database import TransactionBounds, sql_value
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.context import BROKEN_CONNECTION, Database, connection_gone
from dedupe.effects.run_effects import RunEffects
from dedupe.errors import DedupeError
from dedupe.sql import queries

logger = logging.getLogger("dedupe.asgi")

# The answer of a run cut off at its bound: retry soon; the retry runs under a lease.
TOO_LONG_RETRY_AFTER_S = 1
# Past this share of recent keyed requests that found their key stored, the one-transaction
# path reads the key's row in a shared statement before it takes a connection (ReadFirst): a
# replay's claim in a transaction costs about three times the read, which a new key pays
# for nothing.
READ_FIRST_SHARE = 0.25
READ_FIRST_WINDOW = 16

Predicate = Callable[[str, str], bool]


def compile_one_transaction(spec: bool | Predicate) -> Predicate:
    """The middleware's one_transaction=: True (every keyed request), False (none), or a
    callable (method, path) -> bool."""
    if isinstance(spec, bool):
        return lambda method, path: spec
    if callable(spec):
        return spec
    raise TypeError("one_transaction= is True, False or a callable (method, path) -> bool")


class ClaimTransaction(Database):
    """`request.state.idempotency.db` of a one-transaction run: the pooled connection whose
    open transaction holds the claim. `started` says whether the endpoint used it; the run
    commits it (`commit`: with the pool's reset in the COMMIT's round trip) or rolls it back
    (`close`), then the connection goes back to the pool."""

    def __init__(self, pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
        super().__init__(pool)
        self.conn: asyncpg.Connection | None = conn
        self.used = False
        self.committed = False
        self.completing = False  # the run's completion is under way: commit() is its own

    def ended_by_endpoint(self) -> bool:
        """Whether the claim's transaction is no longer open though nothing of ours ended it:
        the endpoint sent a COMMIT or ROLLBACK itself (asyncpg's own record, no round trip)."""
        conn = self.conn
        return conn is not None and not self.committed and not conn.is_in_transaction()

    @property
    def started(self) -> bool:
        return self.used

    async def connection(self) -> asyncpg.Connection:
        if self._closed or self.conn is None:
            raise RuntimeError("request.state.idempotency.db is closed: the request's run is over")
        self.used = True
        return self.conn

    async def commit(self) -> None:
        if not self.completing:
            raise RuntimeError(
                "request.state.idempotency.db commits with the stored response, after the "
                "endpoint: do not commit or roll it back yourself"
            )
        conn = await self.connection()
        reset = conn.get_reset_query()
        await conn.execute(f"COMMIT; {reset}" if reset else "COMMIT")
        self.committed = True
        conn.mark_clean()  # reset already, with the COMMIT

    async def complete_and_commit(self, completion: Completion) -> bool:
        """The run's completion (no outbox rows) and the COMMIT with the pool's reset, in one
        round trip (dedupe.claims.completion.complete_and_commit); then the connection goes
        back. False: the fence refused it, everything is rolled back."""
        conn = await self.connection()
        try:
            done = await complete_and_commit(conn, completion, reset=conn.get_reset_query())
            if done:
                self.committed = True
                conn.mark_clean()  # reset already, after the COMMIT
            return done
        finally:
            await self.close()

    async def close(self) -> None:
        """Roll back what was not committed and return the connection; safe to call twice."""
        self._closed = True
        self.forget_blocks()  # (as Database.close: the run's marks close a cycle)
        conn, self.conn = self.conn, None
        if conn is None:
            return
        broken = BROKEN_CONNECTION
        try:
            if not self.committed and not connection_gone(conn):
                # The ROLLBACK carries the pool's reset when the endpoint used the connection
                # (it may have left session state); one round trip either way.
                reset = conn.get_reset_query() if self.used else ""
                await asyncio.shield(conn.execute(f"ROLLBACK; {reset}" if reset else "ROLLBACK"))
                conn.mark_clean()
        except broken:
            with contextlib.suppress(*broken):
                conn.terminate()
        except asyncio.CancelledError:
            with contextlib.suppress(*broken):
                conn.terminate()
            raise
        finally:
            with contextlib.suppress(*broken):
                await self.pool.release(conn)


@dataclass(frozen=True, slots=True)
class Claimed:
    """What the claim in the transaction found: our token (SESSION_TOKEN for the claim of
    `claim`), or the row in the way (its status, stored result and whether this request is the
    same; all None for a row not committed, or gone since the claim)."""

    token: int | None
    status: str | None = None
    result: str | None = None
    same_payload: bool | None = None

    @property
    def replay(self) -> bool:
        """A finished key and the same request: its stored answer is the reply."""
        return self.status == "completed" and self.same_payload is True


async def claim(
    db: ClaimTransaction,
    request: ClaimRequest,
    bounds: TransactionBounds,
    *,
    owner: str,
    retention_s: float,
) -> Claimed:
    """BEGIN with the bounds and claim the key inside the transaction, in one round trip: a
    simple query that EXECUTEs dedupe_http_claim_v1 (queries.sql, prepare_http_one_transaction;
    prepared in the same query on a session that lacks it). A key claimed has SESSION_TOKEN
    for its token (the completion fences on the token the claim drew); a key with a row in the
    way has it read in a second round trip, in the transaction. A key another transaction holds
    raises asyncpg.LockNotAvailableError after bounds.lock_s; driver errors are raised as they
    come."""
    conn = db.conn
    assert conn is not None
    values = (*request.row(owner), float(retention_s), secrets.randbits(63))
    claim_sql = f"EXECUTE dedupe_http_claim_v1({', '.join(map(sql_value, values))})"
    begin = f"{bounds.begin()};\n"
    try:
        # The PREPAREs inside the transaction, under its bounds (an INSERT's PREPARE takes the
        # table's lock, as the claim does).
        status = await conn.execute(f"{begin}{conn.prepares()}{claim_sql}")
    except (asyncpg.InvalidSQLStatementNameError, asyncpg.DuplicatePreparedStatementError):
        # The session's statements are not what the connection was marked with (an endpoint
        # deallocated them on its request.state.idempotency.db, or a PREPARE sent did not
        # run): prepared again, once.
        await conn.prepare_again()
        status = await conn.execute(f"{begin}{conn.prepares()}{claim_sql}")
    if status == "INSERT 0 1":
        return Claimed(SESSION_TOKEN)
    [row] = await conn.fetch(
        queries()["look_up"],
        [request.scope],
        [request.key],
        [request.payload_hash],
        [request.fingerprint],
        [request.raw_hash],
    )
    return Claimed(None, row["status"], row["result"], row["same_payload"])


class LookUps:
    """The committed rows of keys about to be claimed in one transaction, read in statements
    shared by concurrent requests (dedupe.claims.batching), on the claims' pool: a replay is
    answered by the read, as the two-commit claim answers it, and never takes a connection of
    its own nor opens a transaction."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._batcher: Batcher[ClaimRequest, Claimed] = Batcher(self._flush)

    async def look_up(self, request: ClaimRequest) -> Claimed:
        """The row of the key (token None); raises what the read raised."""
        [found] = await self._batcher.submit_many([request])
        return found

    async def _flush(self, batch: Sequence[ClaimRequest]) -> list[Claimed]:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                queries()["look_up"],
                [r.scope for r in batch],
                [r.key for r in batch],
                [r.payload_hash for r in batch],
                [r.fingerprint for r in batch],
                [r.raw_hash for r in batch],
            )
            conn.mark_clean()  # a read: no session state to reset
        return [Claimed(None, r["status"], r["result"], r["same_payload"]) for r in rows]


class ReadFirst:
    """Whether a one-transaction request reads its key's committed row first (LookUps) or goes
    straight to its claim, whose own read answers a replay as well (at the price of a pooled
    connection and a transaction opened and rolled back). The read pays off when many keys are
    found stored (a wave of retries), and is wasted on new keys: it is done while more than
    READ_FIRST_SHARE of the recent keyed requests found a committed row (a moving average over
    about READ_FIRST_WINDOW requests; it starts at 1: a process just started may be serving
    the retries of one that died). Only the cost moves: both paths answer alike."""

    __slots__ = ("share",)

    def __init__(self) -> None:
        self.share = 1.0

    def __bool__(self) -> bool:
        return self.share > READ_FIRST_SHARE

    def saw(self, stored: bool) -> None:
        """A keyed request found its key with a committed row (stored) or without one."""
        self.share += ((1.0 if stored else 0.0) - self.share) / READ_FIRST_WINDOW


class NeedsTwoCommits(DedupeError):
    """request.state.idempotency.step in a one-transaction request: a step's record commits on
    its own before the external call it guards can be trusted not to repeat, which a request
    whose claim is not committed yet cannot do. This attempt fails (rolled back, the key given
    back); the client's retry runs on the two-commit path, where the step works. Leave the
    route out of one_transaction= (do not catch this error)."""


class _Effects(RunEffects):
    """Publishes as in any run (their rows commit in the one transaction); steps refused."""

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NeedsTwoCommits(
            f"request.state.idempotency.step({name!r}) needs the two-commit path: leave this "
            "route out of IdempotencyMiddleware(one_transaction=...); the client's retry runs "
            "there"
        )


def effects(db: Database, run: KeyedRun) -> RunEffects:
    """request.state.idempotency's publishes and steps for a one-transaction run."""
    return _Effects(db, run.fence, cancel=run.lose)


@dataclass(slots=True)
class OneTransactionRun(KeyedRun):
    """A keyed run whose claim is in `db`'s open transaction: no lease and no heartbeat (the
    row lock holds the key); the endpoint is bounded until its response is committed."""

    request: ClaimRequest | None = None
    bounds: TransactionBounds | None = None
    _cut: bool = False

    def _hold(self) -> Held:
        # Not heartbeated: the row is not committed, a heartbeat would not find it.
        return Held(self.fence, self.bounds.run_s if self.bounds is not None else 0.0)

    async def _endpoint(self, scope: Scope, receive: Receive) -> tuple[bool, BaseException | None]:
        """The endpoint in the request's own task (no heartbeat nor step cancels it: there is
        no lease, steps are refused), bounded while its response is being buffered: past the
        bound it is cancelled and its transaction rolled back (_cut_off). A response being
        committed, or committed and streaming, is waited for. Whatever it raises but a
        cancellation not ours (or KeyboardInterrupt, SystemExit) is returned, for the run to
        settle before it is raised."""
        assert self.bounds is not None
        task = asyncio.current_task()
        assert task is not None
        # The cancellations asked of this task before ours (as asyncio.timeout counts them): an
        # outer one is told from ours by the count left once ours is taken back.
        before = task.cancelling()
        timer = asyncio.get_running_loop().call_later(self.bounds.run_s, self._expire, task)
        only_ours = False
        try:
            try:
                await self.app(scope, receive, self._send)
            finally:
                timer.cancel()
                if self._cut:  # ours is taken back once, however the endpoint ended
                    only_ours = task.uncancel() <= before
        except asyncio.CancelledError:
            # Ours (the bound) is answered here; anyone else's (a server shutting down) goes
            # on. An endpoint that swallows a cancellation swallows both: it is its own to
            # re-raise, as in any ASGI app.
            if self._cut and only_ours:
                return True, None
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            return False, exc
        return False, None

    def _expire(self, task: asyncio.Task[Any]) -> None:
        if self._mode == "buffering" and self._held is not None and not self._held.completing:
            self._cut = True
            task.cancel()

    async def _cut_off(self) -> bool:
        if not self._cut:
            return False
        logger.warning(
            "key %s: the endpoint ran past the one-transaction bound (%gs); rolled back, the "
            "key is released: the retry runs under a lease",
            self.fence.key,
            self.bounds.run_s if self.bounds is not None else 0.0,
            extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "too_long"},
        )
        await self._settle_error()
        self.outcome = "too_long"
        await self._refuse(too_long())
        return True

    def _in_transaction(self, completion: Completion) -> bool:
        return True  # the claim is in it

    async def _complete_in_transaction(self, completion: Completion) -> bool:
        assert isinstance(self.db, ClaimTransaction)  # the middleware's, for every such run
        self.db.completing = True
        if self.db.ended_by_endpoint():
            # Its writes (and the claim, completed in place) committed or rolled back already:
            # the completion below stores the response where the claim was committed (later
            # retries replay it), and is refused where it was rolled back (a 503, released).
            _ended_by_endpoint(self.fence)
        # Without publishes, the completion and the COMMIT go in one round trip.
        if completion.outbox:
            fence = completion.fence
            if fence.token == SESSION_TOKEN:  # the claim's token, drawn in this session
                conn = await self.db.connection()
                token = int(await conn.fetchval("SELECT currval('dedupe_claim_tokens')"))
                completion = completion._replace(fence=Fence(fence.scope, fence.key, token))
            return await KeyedRun._complete_in_transaction(self, completion)
        return await self.db.complete_and_commit(completion)

    async def _settle_error(self) -> None:
        """Roll everything back (the claim with it), then commit the attempt on its own, handed
        back: the retry is counted as attempt 2 and runs on the two-commit path."""
        if self._held is None or self._held.lost or self._mode != "buffering":
            await self.db.close()
            return
        self._held.completing = True
        if isinstance(self.db, ClaimTransaction) and self.db.ended_by_endpoint():
            await self._hand_back_ended()
        await self.db.close()
        self.outcome = "released_on_error"
        self._mode = "settled"
        if self.request is None:
            return
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):  # the lock wait is bounded below it
                await self.store.first_attempt_failed(
                    self.request, retention_s=self.retention_s, bounds=self.bounds
                )
        except asyncpg.LockNotAvailableError:
            # As for the claim: the key is held by a run still open (a duplicate that claimed
            # it once this transaction rolled back). Its outcome decides, as when its row is
            # committed already; this attempt is not counted and its answer goes out now.
            logger.info(
                "key %s: the failed attempt is not counted: the key is held by another request "
                "still running (waited %gs)",
                self.fence.key,
                self.bounds.lock_s if self.bounds is not None else 0.0,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "not_counted"},
            )
        except Exception as exc:
            # Nothing of the attempt is kept: the retry runs again as attempt 1.
            logger.warning(
                "key %s: could not count the failed attempt (%s: %s)",
                self.fence.key,
                exc.__class__.__name__,
                exc,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "not_counted"},
            )

    async def _hand_back_ended(self) -> None:
        """The endpoint ended the claim's transaction itself, then failed: a claim row it
        committed is handed back (queries.sql, hand_back_ended_one_transaction), in the claim's
        session, before the connection goes back."""
        _ended_by_endpoint(self.fence)
        assert isinstance(self.db, ClaimTransaction) and self.db.conn is not None
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                await self.db.conn.execute(
                    queries()["hand_back_ended_one_transaction"], self.fence.scope, self.fence.key
                )
        except Exception as exc:
            logger.warning(
                "key %s: could not hand back the claim its endpoint committed (%s: %s)",
                self.fence.key,
                exc.__class__.__name__,
                exc,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "not_released"},
            )


def _ended_by_endpoint(fence: Fence) -> None:
    logger.error(
        "key %s: the endpoint committed or rolled back request.state.idempotency.db itself; it "
        "commits with the stored response: do not end its transaction",
        fence.key,
        extra={"scope": fence.scope, "key": fence.key, "outcome": "ended_by_endpoint"},
    )


def too_long() -> Problem:
    """503: the request ran past its one-transaction bound; nothing of it was kept."""
    return Problem(
        503,
        "too-long",
        "Request took too long",
        "the request ran past its bound and was rolled back (nothing was kept); retry: the "
        "retry runs without the bound",
        TOO_LONG_RETRY_AFTER_S,
    )


__all__ = [
    "ClaimTransaction",
    "Claimed",
    "LookUps",
    "NeedsTwoCommits",
    "OneTransactionRun",
    "ReadFirst",
    "claim",
    "compile_one_transaction",
    "effects",
    "too_long",
]
