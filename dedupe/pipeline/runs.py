"""A claim of ours, run: the handler's attempts with retries and backoff, its completion fenced
with its ctx.db writes (or queued for the next shared statement), and what becomes of a run
that is taken over, stopped, or fails for good."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dedupe.app import App, Handler
from dedupe.claims.batching import Batcher
from dedupe.claims.completion import Completion, complete_in_transaction
from dedupe.claims.leases import Lease, Leases
from dedupe.claims.records import Fence, Reason
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import encode_result
from dedupe.claims.verdicts import Ours
from dedupe.context import Context, Database
from dedupe.effects import outbox
from dedupe.effects.outbox import Outgoing
from dedupe.effects.run_effects import RunEffects
from dedupe.errors import DedupeError, InvalidPayload, LeaseLost, Reject, StoreError
from dedupe.message import Message
from dedupe.pipeline.failures import describe, retry_delay, transient
from dedupe.pipeline.group_commit import GroupRolledBack, Lanes, Member, group_commit_lanes
from dedupe.pipeline.hooks import Hooks
from dedupe.pipeline.observers import Observer
from dedupe.pipeline.outcomes import (
    REQUEUE_STOPPING,
    REQUEUE_WITHDRAWN,
    Outcome,
    Pending,
    Ticket,
    dead_letter,
    lease_lost,
    store_unavailable,
)
from dedupe.pipeline.stats import Stats
from dedupe.transport import Action, Settlement

logger = logging.getLogger("dedupe.pipeline")


class _CrashLoop(DedupeError):
    """The key was taken over from dead workers more than max_attempts times."""


class _Withdrawn(BaseException):
    """The transport took the delivery back while its claim waited for a slot: the claim is
    given back, nothing runs. A BaseException, so that no handler error path (retries, give
    up) takes it for the run's failure."""


@dataclass(eq=False, slots=True)
class _Writes:
    """What an attempt writes through: ctx.db (its own transaction, or its group's lane), the
    group member it runs as, and its publishes and steps."""

    db: Database | None  # None: the handler takes no ctx
    member: Member | None = None
    effects: RunEffects | None = None

    @property
    def outgoing(self) -> list[Outgoing]:
        return self.effects.outgoing if self.effects is not None else []


class Runner:
    """Runs the handlers of claims we hold, at most `concurrency` at a time."""

    def __init__(
        self,
        app: App,
        store: ClaimStore,
        leases: Leases,
        stats: Stats,
        observer: Observer,
        *,
        concurrency: int,
        park_after_s: float = 5.0,
    ) -> None:
        self.store = store
        # A retry that waits at least this long goes through the broker (parked), the key
        # given back; a shorter one waits here, the lease held (heartbeats go on).
        self.park_after_s = park_after_s
        self.leases = leases
        self.stats = stats
        self.observer = observer
        self.hooks = Hooks(app)
        self.stopping = False
        # Called after a commit that stored publishes (the relay sends them at once).
        self._on_published: Callable[[], None] | None = None
        self._slots = self.slots = asyncio.Semaphore(concurrency)
        self._isolation = asyncio.Lock()
        self._completer: Batcher[tuple[Fence, str, float], bool] = Batcher(self._complete_batch)
        self.lanes = Lanes(store, lanes=group_commit_lanes(concurrency), stats=stats)
        # Runs whose only writes are publishes: completed with their outbox rows, a batch at once.
        self._publishing = outbox.PublishingCompletions(store, on_committed=self._published)

    @property
    def on_published(self) -> Callable[[], None] | None:
        return self._on_published

    @on_published.setter
    def on_published(self, callback: Callable[[], None] | None) -> None:
        self._on_published = callback
        self.lanes.set_on_published(callback)

    async def run(self, ticket: Ticket, ours: Ours) -> Outcome:
        """Run the handler on a claim of ours, in the calling (runner's) task."""
        handler, message = ticket.handler, ticket.message
        task = asyncio.current_task()
        assert task is not None
        lease = self.leases.take(ours, lease_s=handler.lease_s, task=task)
        if lease.lost:  # taken over while it waited for a runner
            self.leases.forget(lease)
            self.stats.lease_lost += 1
            return lease_lost(handler)
        if self.stopping:
            await self.leases.release(lease)
            return REQUEUE_STOPPING
        if ticket.withdrawn:  # e.g. its Kafka partition was revoked: the next owner runs it
            await self.leases.release(lease)
            return REQUEUE_WITHDRAWN
        if ours.taken_over:
            self.stats.taken_over += 1
        try:
            try:
                payload = handler.decode(message)
            except InvalidPayload as exc:
                return await self._give_up(handler, lease.fence, Reason.INVALID_PAYLOAD, str(exc))
            return await self._attempts(ticket, payload, lease)
        except _Withdrawn:
            await self.leases.release(lease)
            return REQUEUE_WITHDRAWN
        except asyncio.CancelledError:
            if not (lease.lost or lease.stopping):
                raise
            task.uncancel()
            if lease.lost:
                self.stats.lease_lost += 1
                _log(handler, message, lease).warning(
                    "lease lost to another worker; this run's writes were rolled back"
                )
                return lease_lost(handler)
            self.leases.forget(lease)  # no heartbeat reads a handed-back key as lost
            await self.leases.give_back(lease)
            return REQUEUE_STOPPING
        finally:
            self.leases.forget(lease)

    async def _attempts(self, ticket: Ticket, payload: Any, lease: Lease) -> Outcome:
        """Run the handler until it succeeds, fails for good, or runs out of attempts.

        tenacity's schedule (wait, before_sleep) without its per-call set-up, which cost more
        than the rest of a no-op run; a retry is rare, a first attempt is not. The loop runs in
        this frame: every frame between a run and its runner task costs at each resume.
        """
        handler, message, fence = ticket.handler, ticket.message, lease.fence
        try:
            while True:
                try:
                    result = await self._attempt(ticket, payload, lease)
                    break
                except Exception as exc:
                    if not transient(handler, exc) or lease.attempt >= handler.max_attempts:
                        raise
                    delay = retry_delay(handler, lease.attempt, exc)
                    if delay >= self.park_after_s:
                        return await self._park(handler, message, lease, delay, exc)
                    await self._before_retry(handler, message, lease, delay, exc)
        except LeaseLost:
            self.stats.lease_lost += 1
            return lease_lost(handler)
        except StoreError as exc:
            _log(handler, message, lease).warning("claim store unavailable, requeueing: %s", exc)
            return store_unavailable(str(exc))
        except _CrashLoop as exc:
            return await self._give_up(handler, fence, Reason.MAX_ATTEMPTS, str(exc))
        except Reject as exc:
            return await self._give_up(handler, fence, Reason.REJECTED, exc.reason)
        except Exception as exc:
            if transient(handler, exc):
                detail = f"{lease.attempt} attempts, last: {describe(exc)}"
                return await self._give_up(handler, fence, Reason.MAX_ATTEMPTS, detail)
            return await self._give_up(handler, fence, Reason.HANDLER_ERROR, describe(exc))
        if isinstance(result, Pending):
            return result
        self.stats.completed += 1
        return Settlement(Action.ACK, result=result)

    async def _before_retry(
        self, handler: Handler, message: Message, lease: Lease, delay: float, exc: Exception
    ) -> None:
        """Record the failed attempt (fenced), then wait out the short delay before the next."""
        self.stats.retried += 1
        _log(handler, message, lease).warning(
            "attempt %d of %d failed (%s); retrying",
            lease.attempt,
            handler.max_attempts,
            describe(exc),
        )
        attempt = await self.store.record_attempt(
            lease.fence, attempt=lease.attempt + 1, error=describe(exc), lease_s=handler.lease_s
        )
        if attempt is None:
            raise LeaseLost()
        lease.attempt = attempt  # the lines of the next attempt carry its number
        await asyncio.sleep(delay)

    async def _park(
        self, handler: Handler, message: Message, lease: Lease, delay: float, exc: Exception
    ) -> Settlement:
        """A retry that would wait `delay` (at least park_after_s) goes through the broker.

        The failed attempt stays counted on the claim; the key is given back at once (marked
        handed back, as at a graceful stop: its next run is counted at its start and need not
        run alone), and the message is deferred by `delay` (RabbitMQ: a delay queue; Kafka: a
        retry topic). Nothing is held meanwhile: no lease, no slot, no sleeping task. A copy
        of the key delivered sooner may take it and run it; the parked one then finds it
        finished (a duplicate) or counts one more attempt.
        """
        self.stats.retried += 1
        _log(handler, message, lease).warning(
            "attempt %d of %d failed (%s); retrying in %.3g s through the broker",
            lease.attempt,
            handler.max_attempts,
            describe(exc),
            delay,
        )
        self.leases.forget(lease)  # no heartbeat extends the lease from now on
        try:
            ours = await self.store.give_back(lease.fence, handed_back=True)
        except StoreError as exc_store:
            # The lease lapses on its own: the parked copy meets it, waits, then takes it over.
            logger.warning(
                "could not give back %s/%s before parking it: %s",
                lease.fence.scope,
                lease.fence.key,
                exc_store,
            )
            ours = True
        if not ours:  # taken over meanwhile: the new owner's outcome decides
            self.stats.lease_lost += 1
            return lease_lost(handler)
        return Settlement(
            Action.DEFER,
            delay_s=delay,
            detail=f"retry parked after attempt {lease.attempt}: {describe(exc)}",
        )

    async def _attempt(self, ticket: Ticket, payload: Any, lease: Lease) -> str | Pending:
        """One run of the handler, then its completion, atomically with its ctx.db writes.

        A run that wrote nothing through ctx.db queues its completion for the next batched
        statement and returns it pending; the batch's concluder finishes it after the commit.
        The handler is awaited in this frame (see _attempts).
        """
        handler = ticket.handler
        writes = _Writes(Database(self.store.pool) if handler.takes_context else None)
        # The first run after a take-over (not counted yet) runs alone.
        isolate = self._isolation if lease.taken_over and not lease.counted else None
        try:
            if isolate is not None:
                await isolate.acquire()
            try:
                async with self._slots:
                    if not lease.started and ticket.withdrawn:
                        raise _Withdrawn()  # taken back while it waited: the run never began
                    lease.started = True
                    if not lease.counted:
                        await self._count_take_over(handler, lease)
                        lease.counted = True
                    if self.hooks.any("claimed"):
                        await self.hooks("claimed", ticket.message, lease.fence)
                    # A taken-over key's first run (alone) keeps out of the groups: if it is
                    # what kills workers, it takes no other run's writes down with it.
                    if writes.db is not None and handler.group_commit and isolate is None:
                        writes.member = await self.lanes.join()
                        writes.db = writes.member.db
                    call = self._call(ticket, payload, lease, writes)
                    began, ok = time.perf_counter(), False
                    try:
                        if handler.timeout_s is not None:
                            async with asyncio.timeout(handler.timeout_s):
                                value = await call
                        else:
                            value = await call
                        ok = True
                    finally:
                        self.observer.ran(handler.name, time.perf_counter() - began, ok=ok)
            finally:
                if isolate is not None:
                    isolate.release()
            if lease.lost:  # a step found the key taken over; the handler went on regardless
                raise LeaseLost()
            result = encode_result(value)
            if self.hooks.any("handled"):
                await self.hooks("handled", ticket.message, lease.fence)
            lease.completing = True
            return await self._complete(ticket, lease, writes, result)
        except GroupRolledBack:
            # The group gave this key back (handed back) before telling us: no heartbeat may
            # read it as lost meanwhile; the message is requeued and the lease forgotten.
            raise
        except BaseException:
            lease.completing = False  # the next attempt may be cancelled again
            raise
        finally:
            # A run that completed stays `completing`: a heartbeat that read the leases before
            # the completion committed must not take the finished run for a lost one.
            if writes.member is not None:
                await writes.member.leave()
            if writes.db is not None:
                await writes.db.close()

    def _call(self, ticket: Ticket, payload: Any, lease: Lease, writes: _Writes) -> Awaitable[Any]:
        """The handler's call, not awaited yet; a handler that takes a ctx gets it here, with
        the attempt's ctx.db and effects."""
        handler, message, fence = ticket.handler, ticket.message, lease.fence
        if writes.db is None:
            return handler.fn(payload)
        writes.effects = RunEffects(writes.db, fence, cancel=functools.partial(_lose, lease))
        ctx = Context(
            key=fence.key,
            scope=fence.scope,
            attempt=lease.attempt,
            message=message,
            db=writes.db,
            logger=_log(handler, message, lease),
            effects=writes.effects,
        )
        return handler.fn(payload, ctx)

    async def _complete(
        self, ticket: Ticket, lease: Lease, writes: _Writes, result: str
    ) -> str | Pending:
        """Complete a run that returned: with its group, in its own transaction (ctx.db), or
        queued for a shared statement (pending, with or without its publishes)."""
        handler, fence = ticket.handler, lease.fence
        outgoing = writes.outgoing
        if writes.member is not None:
            committed = await writes.member.complete(
                fence,
                result,
                handler.retention_s,
                outgoing,
                attempt=lease.attempt,
                lease_s=handler.lease_s,
            )
            return Pending(ticket, fence, result, committed)
        if writes.db is not None and writes.db.started:
            completion = Completion(fence, result, handler.retention_s, outgoing)
            if not await complete_in_transaction(self.store, writes.db, completion):
                self.stats.fenced += 1
                raise LeaseLost()
            if outgoing and self._on_published is not None:
                self._on_published()
        elif outgoing:
            completion = Completion(fence, result, handler.retention_s, outgoing)
            return Pending(ticket, fence, result, self._publishing.submit_nowait(completion))
        else:
            queued = self._completer.submit_nowait((fence, result, handler.retention_s))
            return Pending(ticket, fence, result, queued)
        if self.hooks.any("completed"):
            await self.hooks("completed", ticket.message, fence)
        return result

    async def _count_take_over(self, handler: Handler, lease: Lease) -> None:
        """Count the start of a taken-over key's run; too many starts is a crash loop."""
        attempt = await self.store.record_attempt(
            lease.fence, attempt=lease.attempt + 1, error=None, lease_s=handler.lease_s
        )
        if attempt is None:
            raise LeaseLost()
        lease.attempt = attempt
        if attempt > handler.max_attempts:
            raise _CrashLoop(
                f"started {attempt - 1} times without finishing (max_attempts="
                f"{handler.max_attempts}): its workers died or lost the database"
            )

    def _published(self) -> None:
        if self._on_published is not None:
            self._on_published()

    async def _complete_batch(self, items: Sequence[tuple[Fence, str, float]]) -> list[bool]:
        done = await self.store.complete(items)
        return [fence.ident in done for fence, _, _ in items]

    async def _give_up(
        self, handler: Handler, fence: Fence, reason: Reason, detail: str
    ) -> Settlement:
        """Mark the key failed, then dead-letter the message.

        Only once the failure is recorded: a dead letter whose claim stayed in progress would
        leave its key stuck with no delivery left to finish it, so then the message is requeued
        and the next delivery tries again.
        """
        try:
            recorded = await self.store.fail(
                fence, reason=reason, detail=detail, retention_s=handler.retention_s
            )
        except StoreError as exc:
            logger.warning(
                "could not mark %s/%s failed, requeueing: %s", fence.scope, fence.key, exc
            )
            return store_unavailable(str(exc))
        if not recorded:  # another worker owns the key now; let its outcome decide
            self.stats.lease_lost += 1
            return lease_lost(handler)
        return dead_letter(reason, detail, fence, failed_claim=True)


def _lose(lease: Lease) -> None:
    """A step found the key taken over: this run is a zombie; its outcome is lease lost, even if
    the handler catches the step's LeaseLost and returns (nothing it wrote commits)."""
    lease.lost = True


@functools.cache
def _handler_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"dedupe.handler.{name}")


def _log(handler: Handler, message: Message, lease: Lease) -> logging.LoggerAdapter[logging.Logger]:
    """The handler's logger with the message's scope, key, id and attempt on every line."""
    return logging.LoggerAdapter(
        _handler_logger(handler.name),
        {
            "handler": handler.name,
            "scope": lease.fence.scope,
            "key": lease.fence.key,
            "message_id": message.message_id,
            "attempt": lease.attempt,
        },
    )


__all__ = ["Runner"]
