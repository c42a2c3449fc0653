"""One transaction where one is enough (`one_transaction=True`): a first delivery's claim, its
handler's ctx.db writes and its completion in one transaction on one pooled connection.

    BEGIN; SET LOCAL lock_timeout, idle_in_transaction_session_timeout, statement_timeout
    INSERT the claim (attempts = 1, a token from the claims' sequence) ON CONFLICT DO NOTHING
    the handler, with ctx.db on this transaction ("claimed" and "handled" hooks around it)
    the fenced completion (token = ours), the run's outbox rows
    COMMIT, then the delivery is settled (acked)

Nothing is visible to anyone before the COMMIT. A competing copy of the message on another
worker meets our uncommitted row: its insert (this one's or claim_batch's upsert) waits on it,
then sees the key completed (a duplicate) or, if we rolled back, claims it. Whatever does not
fit leaves this path before anything committed and goes to the two-commit path
(dedupe.pipeline.runs), which decides as usual; the reasons are counted
(Stats.one_transaction_fallbacks):

- `key_exists`: the key has a row already (a delivery before this one claimed it);
- `lock_timeout`: another transaction holds the key (a run like this one, or a frozen worker's
  until its session is ended): settled as a key in flight elsewhere, deferred, never run;
- `failed`: the handler, a hook, a deferred constraint or the completion raised: everything
  rolled back, then the failed attempt is committed on its own (attempts = 1) so that the
  two-commit path counts the next run as attempt 2 and a poison message is dead-lettered after
  max_attempts runs in all;
- `too_long`: the run outlasted its bound (the lease, or timeout_s if shorter, which then
  counts as `failed`): cancelled and rolled back;
- `step`: the handler called ctx.step, whose record needs a commit of its own before the
  external call it guards can be trusted not to repeat: rolled back, run on the two-commit path;
- `store`: the database failed under the run (nothing, or an unknown outcome, committed: the
  two-commit claim tells which);
- `invalid_payload`: the two-commit path dead-letters it with its claim recorded.

The argument why this is exactly-once is in docs/design.md, "One transaction where one is
enough".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from dedupe.app import Handler
from dedupe.claims.completion import Completion, complete_in
from dedupe.claims.database import TRANSIENT_ERRORS, TransactionBounds
from dedupe.claims.records import Fence
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import encode_result, storable_text
from dedupe.context import Context, connection_gone
from dedupe.effects.run_effects import RunEffects
from dedupe.errors import DedupeError, InvalidPayload, StoreError
from dedupe.message import Message
from dedupe.pipeline.failures import describe, retry_delay, transient
from dedupe.pipeline.group_commit import TAINTED, LaneDatabase
from dedupe.pipeline.hooks import Hooks
from dedupe.pipeline.observers import Observer
from dedupe.pipeline.outcomes import REQUEUE_INTERNAL, REQUEUE_WITHDRAWN, Ticket
from dedupe.pipeline.stats import Stats
from dedupe.transport import Action, Settlement

logger = logging.getLogger("dedupe.pipeline")


# Why a message left the one-transaction path (the label of the fall-back counter).
REDELIVERY = "redelivery"  # a redelivery, a held retry, a partition's first batch
REPEAT = "repeat"  # the batch holds the key twice: the second waits for the first's outcome
NO_KEY = "no_key"  # no claim can be made: the two-commit path dead-letters it
SHARED_CHANNEL = "shared_channel"  # several handlers on its channel
STOPPING = "stopping"
KEY_EXISTS = "key_exists"
LOCK_TIMEOUT = "lock_timeout"
FAILED = "failed"
TOO_LONG = "too_long"
STEP = "step"
STORE = "store"
INVALID_PAYLOAD = "invalid_payload"


class NeedsOwnCommits(DedupeError):
    """ctx.step in a one-transaction run: a step's record commits on its own, before the run
    goes on, so that a crash after the external call does not repeat it; inside the run's one
    transaction the record would roll back with it. This run is rolled back and runs again on
    the two-commit path, where the step works (do not catch this error)."""


def first_delivery(message: Message) -> bool:
    """Whether the transport says this is the message's first delivery: `meta["redelivered"]`
    is False (RabbitMQ: not redelivered; Kafka: not in a partition's first batch after it was
    assigned) and it is its first attempt as far as the transport knows (not a deferred copy
    back from a delay queue, not a held retry). A transport that says nothing gets the
    two-commit path."""
    return message.attempt == 1 and message.meta.get("redelivered", True) is False


def run_bound(handler: Handler) -> tuple[float, bool]:
    """The run's bound (seconds) and whether reaching it counts as a failed attempt."""
    counted = handler.timeout_s is not None and handler.timeout_s <= handler.lease_s
    bound = handler.timeout_s if counted and handler.timeout_s is not None else handler.lease_s
    return bound, counted


def transaction_bounds(handler: Handler) -> TransactionBounds:
    """The lock wait and session timeouts of the handler's one transaction (and of counting
    its failed first attempt)."""
    bound, _ = run_bound(handler)
    return TransactionBounds.of(handler.lease_s, bound)


def begin_statement(handler: Handler) -> str:
    """BEGIN with the transaction's bounds, in one round trip (numbers only: no values)."""
    return transaction_bounds(handler).begin()


@dataclass(eq=False, slots=True)
class _Failed:
    """The run failed: its attempt is to be committed on its own."""

    error: BaseException


class _Effects(RunEffects):
    """ctx.publish as in any run (its rows go in the one transaction); ctx.step refused."""

    step_called = False

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.step_called = True
        raise NeedsOwnCommits()


class OneTransaction:
    """Runs first deliveries of one_transaction=True handlers in one transaction each."""

    def __init__(
        self,
        store: ClaimStore,
        stats: Stats,
        observer: Observer,
        hooks: Hooks,
        slots: asyncio.Semaphore,
        stopping: Callable[[], bool] = lambda: False,
        park_after_s: float = 5.0,
    ) -> None:
        self.store = store
        self.park_after_s = park_after_s
        self.stats = stats
        self.observer = observer
        self.hooks = hooks
        self.on_published: Callable[[], None] | None = None
        self._slots = slots
        self._stopping = stopping

    def fall_back(self, reason: str, count: int = 1) -> None:
        self.stats.one_transaction_fallbacks[reason] += count

    async def run(self, ticket: Ticket) -> Settlement | str:
        """The settlement of a run that committed (or of a key in flight elsewhere), or the
        reason the message goes to the two-commit path (nothing of this run committed, except
        a failed attempt's count)."""
        handler = ticket.handler
        try:
            payload = handler.decode(ticket.message)
        except InvalidPayload:
            return self._left(INVALID_PAYLOAD)
        async with self._slots:
            if self._stopping():  # a stop began while it waited for a slot: give it back
                return self._left(STOPPING)
            if ticket.withdrawn:  # its delivery was taken back meanwhile: nothing was claimed
                return REQUEUE_WITHDRAWN
            try:
                conn: asyncpg.Connection = await self.store.pool.acquire()
            except TRANSIENT_ERRORS:
                return self._left(STORE)
            broken = True
            try:
                outcome = await self._in_transaction(conn, ticket, payload)
                broken = connection_gone(conn)
            finally:
                if broken:
                    with contextlib.suppress(Exception):
                        conn.terminate()
                with contextlib.suppress(Exception):
                    await self.store.pool.release(conn)
        if isinstance(outcome, _Failed):
            return await self._count_failure(ticket, outcome.error)
        if isinstance(outcome, str):
            return self._left(outcome)
        return outcome

    def _left(self, reason: str) -> str:
        self.fall_back(reason)
        return reason

    async def _in_transaction(
        self, conn: asyncpg.Connection, ticket: Ticket, payload: Any
    ) -> Settlement | str | _Failed:
        """BEGIN ... COMMIT; every way out but the COMMIT rolls back (or drops the session)."""
        handler, message, request = ticket.handler, ticket.message, ticket.request
        bound, counted = run_bound(handler)
        committed = False
        try:
            try:
                began = time.perf_counter()
                await conn.execute(begin_statement(handler))
                token = await self.store.claim_in(
                    conn, request, lease_s=handler.lease_s, retention_s=handler.retention_s
                )
            except asyncpg.LockNotAvailableError:
                return LOCK_TIMEOUT
            except (*TRANSIENT_ERRORS, asyncpg.PostgresError):
                return STORE
            if token is None:
                return KEY_EXISTS
            self.observer.claimed(handler.name, time.perf_counter() - began, 1)
            fence = Fence(request.scope, request.key, token)
            db = LaneDatabase(conn, self.store.pool)
            effects = _Effects(db, fence, cancel=lambda: None)
            ctx = Context(
                key=fence.key,
                scope=fence.scope,
                attempt=1,
                message=message,
                db=db,
                logger=_log(handler, ticket, fence),
                effects=effects,
            )
            try:
                if self.hooks.any("claimed"):
                    await self.hooks("claimed", message, fence)
                began, ok = time.perf_counter(), False
                try:
                    async with asyncio.timeout(bound):
                        value = await handler.fn(payload, ctx)
                    ok = True
                finally:
                    self.observer.ran(handler.name, time.perf_counter() - began, ok=ok)
                if effects.step_called:
                    return STEP
                if db.tainted:
                    raise StoreError(TAINTED)
                result = encode_result(value)
                if self.hooks.any("handled"):
                    await self.hooks("handled", message, fence)
            except TimeoutError as exc:
                if effects.step_called:
                    return STEP
                if connection_gone(conn):
                    return STORE
                return _Failed(exc) if counted else TOO_LONG
            except Exception as exc:
                if effects.step_called:
                    return STEP
                if connection_gone(conn):
                    return STORE
                return _Failed(exc)
            finally:
                await db.close()
            try:
                done = await complete_in(
                    self.store,
                    conn,
                    [Completion(fence, result, handler.retention_s, effects.outgoing)],
                )
                if not done:  # only if the handler changed the claim row itself
                    return _Failed(StoreError("the completion found the claim changed"))
                # The pool's reset goes with the COMMIT, in the same round trip: released, the
                # connection is clean. (Should a reset statement fail after the COMMIT, the run
                # takes the two-commit path, whose claim finds it completed: a duplicate.)
                reset = conn.get_reset_query()
                await conn.execute(f"COMMIT; {reset}" if reset else "COMMIT")
                committed = True
                mark_clean = getattr(conn, "mark_clean", None)
                if mark_clean is not None:
                    mark_clean()
            except asyncpg.IntegrityConstraintViolationError as exc:  # a deferred constraint
                return _Failed(exc)
            except (*TRANSIENT_ERRORS, asyncpg.PostgresError, StoreError) as exc:
                if connection_gone(conn) or not isinstance(exc, StoreError):
                    return STORE
                return _Failed(exc)
        finally:
            if not committed and not connection_gone(conn):
                try:
                    await asyncio.shield(conn.execute("ROLLBACK"))
                except BaseException:
                    conn.terminate()
                    raise
        self.stats.one_transaction += 1
        self.stats.completed += 1
        if effects.outgoing and self.on_published is not None:
            self.on_published()
        if self.hooks.any("completed"):
            try:
                await self.hooks("completed", message, fence)
            except Exception:
                logger.exception("a completed hook failed; requeueing the message")
                return REQUEUE_INTERNAL
        return Settlement(Action.ACK, result=result)

    async def _count_failure(self, ticket: Ticket, error: BaseException) -> Settlement | str:
        """Commit the failed attempt on its own. The two-commit path runs the message next, at
        once; a retry that asks to wait at least park_after_s (Retry(delay_s), or the backoff
        after attempt 1) is parked instead: deferred through the broker, as the two-commit
        path parks its own (the claim left by first_attempt_failed is handed back already)."""
        handler, request = ticket.handler, ticket.request
        delay = 0.0
        if handler.max_attempts > 1 and transient(handler, error):
            delay = retry_delay(handler, 1, error)
        parked = delay >= self.park_after_s
        logger.warning(
            "%s: attempt 1 of %d failed in one transaction (%s); %s",
            handler.name,
            handler.max_attempts,
            describe(error),
            f"retrying in {delay:.3g} s through the broker"
            if parked
            else "retrying on the two-commit path",
            extra={
                "handler": handler.name,
                "scope": request.scope,
                "key": request.key,
                "message_id": ticket.message.message_id,
                "attempt": 1,
            },
        )
        try:
            await self.store.first_attempt_failed(
                request, retention_s=handler.retention_s, bounds=transaction_bounds(handler)
            )
        except asyncpg.LockNotAvailableError:
            # Another delivery of the key claimed it once this transaction rolled back and its
            # run is still open: its outcome decides, as when its row is committed already.
            # This attempt is not counted; the two-commit path finds the key in flight.
            logger.info(
                "%s: the failed attempt is not counted: key %s is held by another run",
                handler.name,
                request.key,
                extra={"handler": handler.name, "scope": request.scope, "key": request.key},
            )
        except StoreError as exc:
            logger.warning("could not count the failed attempt (%s)", storable_text(str(exc), 200))
            return self._left(STORE)
        self.stats.retried += 1
        if parked:
            self.fall_back(FAILED)
            return Settlement(
                Action.DEFER,
                delay_s=delay,
                detail=f"retry parked after attempt 1: {describe(error)}",
            )
        return self._left(FAILED)


def _log(handler: Handler, ticket: Ticket, fence: Fence) -> logging.LoggerAdapter[logging.Logger]:
    return logging.LoggerAdapter(
        logging.getLogger(f"dedupe.handler.{handler.name}"),
        {
            "handler": handler.name,
            "scope": fence.scope,
            "key": fence.key,
            "message_id": ticket.message.message_id,
            "attempt": 1,
        },
    )


__all__ = [
    "NeedsOwnCommits",
    "OneTransaction",
    "begin_statement",
    "first_delivery",
    "run_bound",
    "transaction_bounds",
]
