"""The processing pipeline: claim (batched) -> run -> complete (fenced) -> settle."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from tenacity import RetryCallState, wait_exponential_jitter

from .app import STAGES, App, Handler, Hook
from .batching import Batcher
from .context import Context, Database
from .errors import (
    DedupeError,
    InvalidKey,
    InvalidPayload,
    KeyMissing,
    LeaseLost,
    Reject,
    Retry,
    StoreError,
)
from .keys import derive_key
from .message import Message
from .observe import Observer, Observers
from .store import Claim, ClaimRequest, ClaimStore, Fence
from .transport import ACK, Action, Delivery, Reason, Settlement
from .values import check_claimable, encode_result, storable_text

logger = logging.getLogger(__name__)

# How many times a key whose row vanished or was not yet visible is claimed again at once.
RECLAIM_TRIES = 3
# Severity order used to combine the outcomes of several handlers of one channel.
_SEVERITY = {Action.ACK: 0, Action.DEFER: 1, Action.REQUEUE: 2, Action.DEAD_LETTER: 3}


@dataclass
class Stats:
    """Counters of what the pipeline decided, for logs, the demo summary and metrics."""

    completed: int = 0
    duplicates: int = 0
    conflicts: int = 0
    retried: int = 0
    deferred: int = 0
    requeued: int = 0
    lease_lost: int = 0
    taken_over: int = 0  # keys claimed from a worker whose lease lapsed
    fenced: int = 0  # completions refused because the token had moved on (zombie writes)
    gc_deleted: int = 0  # expired claims removed by this worker's clean-up
    dead_lettered: collections.Counter[str] = field(default_factory=collections.Counter)

    def snapshot(self) -> dict[str, Any]:
        return {
            "completed": self.completed,
            "duplicates": self.duplicates,
            "conflicts": self.conflicts,
            "retried": self.retried,
            "deferred": self.deferred,
            "requeued": self.requeued,
            "lease_lost": self.lease_lost,
            "taken_over": self.taken_over,
            "fenced": self.fenced,
            "gc_deleted": self.gc_deleted,
            "dead_lettered": dict(self.dead_lettered),
        }


@dataclass(eq=False)
class _Run:
    """A claim we hold, from the claim to its outcome; the heartbeat extends it, and cancels
    its run (or, while it waits for a runner, marks it lost) when another worker took it."""

    fence: Fence
    lease_s: float
    task: asyncio.Task[Any] | None  # None while the claim waits for a runner
    attempt: int  # the attempt number the claim store counts for this key
    # A re-claimed key's attempt is counted just before its first run starts; until then
    # it is not (a graceful stop then has nothing to take back).
    counted: bool = True
    taken_over: bool = False  # a dead worker's key: a crash is in its history, run it alone
    lost: bool = False
    stopping: bool = False
    completing: bool = False
    started: bool = False  # holds a concurrency slot: the handler is about to run or runs


@dataclass(eq=False)
class _Batch:
    """One process() call's queue of deliveries and the runner tasks working through it."""

    work: collections.deque[tuple[Delivery, list[_Planned]]]
    completions: _Completions
    runners: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Observed:
    """What the observers are told about a claimed message once its outcome is known."""

    handler: Handler
    message: Message
    request: ClaimRequest
    started: float
    run: _Run | None = None  # our claim, held until a runner takes it


@dataclass(eq=False, slots=True)
class _Pending:
    """A run whose handler is done and whose completion is queued for the next statement.

    The run's task goes on to its next message instead of waiting for the commit; the batch's
    settler task concludes the message once `done` resolves (True: completed; False: fenced).
    """

    handler: Handler
    message: Message
    fence: Fence
    result: str
    done: asyncio.Future[bool]


class _Completions:
    """The pending completions of one batch, handed from its runners to its settler."""

    __slots__ = ("closed", "queue", "wake")

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[Delivery, _Observed | None, _Pending]] = (
            collections.deque()
        )
        self.wake: asyncio.Future[None] | None = None
        self.closed = False

    def add(self, delivery: Delivery, observed: _Observed | None, pending: _Pending) -> None:
        self.queue.append((delivery, observed, pending))
        self._poke()

    def close(self) -> None:
        self.closed = True
        self._poke()

    def _poke(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


# A message's outcome for one handler, and what to report once it is known (None: nothing,
# the message was settled before any claim).
_Outcome = Settlement | _Pending
_Planned = tuple[Awaitable[_Outcome], _Observed | None]


class _CrashLoop(DedupeError):
    """The key was taken over from dead workers more than max_attempts times."""


def _dead_letter(
    reason: Reason, detail: str, fence: Fence | Claim | None = None, *, failed_claim: bool = False
) -> Settlement:
    token = fence.token if isinstance(fence, Fence) else fence.row_token if fence else None
    return Settlement(
        Action.DEAD_LETTER,
        reason=reason,
        detail=storable_text(detail, 500),
        scope=fence.scope if fence else None,
        key=fence.key if fence else None,
        token=token,
        failed_claim=failed_claim,
    )


def _reason_of(error: str | None) -> Reason:
    """The reason a failed claim recorded (its error starts with it)."""
    prefix = (error or "").split(":", 1)[0]
    return Reason(prefix) if prefix in Reason.__members__.values() else Reason.HANDLER_ERROR


class Processor:
    """Runs an app's handlers on batches of deliveries under the claim protocol."""

    def __init__(
        self,
        app: App,
        store: ClaimStore,
        *,
        concurrency: int = 32,
        gc_interval_s: float | None = 300.0,
        max_defer_s: float = 30.0,
        heartbeat_s: float | None = None,
        observers: Sequence[Observer] = (),
    ) -> None:
        self.app = app
        self.store = store
        self.stats = Stats()
        self.observer = Observers(observers)
        self._channels = app.channels
        self._slots = asyncio.Semaphore(concurrency)
        self._runners = concurrency
        self._isolation = asyncio.Lock()
        self._hooks: dict[str, list[Hook]] = {stage: [] for stage in STAGES}
        for stages, hook in app.hooks:
            for stage in stages:
                self._hooks[stage].append(hook)
        self._runs: dict[tuple[str, str], _Run] = {}
        self._batches: set[_Batch] = set()
        self._stopping = False
        self._gc_interval_s = gc_interval_s
        self._max_defer_s = max_defer_s
        self._completer: Batcher[tuple[Fence, str, float], bool] = Batcher(self._complete_batch)
        # Claims of concurrent batches (one per delivery burst) share statements: whatever
        # arrives while a claim statement is in flight goes out together in the next one.
        self._claimers: dict[str, Batcher[ClaimRequest, Claim]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[Any]] = set()
        self._messages_in_flight = 0
        leases = [h.lease_s for h in app.handlers.values()] or [30.0]
        self._heartbeat_s = heartbeat_s or min(leases) / 3

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Processor:
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="dedupe-heartbeat"))
        if self._gc_interval_s:
            self._tasks.append(asyncio.create_task(self._gc_loop(), name="dedupe-gc"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain(timeout_s=0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def drain(self, *, timeout_s: float) -> None:
        """Give back at once the claims no handler runs yet (queued behind others, waiting for
        a slot), wait for the runs under way; past the timeout, give their keys back too. The
        deliveries given back are requeued."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._stopping = True
        for run in list(self._runs.values()):
            if run.task is not None and not (run.started or run.completing):
                run.stopping = True
                run.task.cancel()
        # The batches' queued deliveries are settled by a runner of their own each (a claim
        # of ours is given back, nothing runs), not left behind the runners' current work.
        for batch in self._batches:
            if batch.work:
                stopper = asyncio.create_task(
                    self._work_through(batch.work, batch.completions), name="dedupe-give-back"
                )
                batch.runners.append(stopper)
                self._inflight.add(stopper)
        # Batches that were still claiming when the wait began start their runs later (one
        # per partition on Kafka): wait for those too, within the same deadline.
        while self._inflight and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._inflight), timeout=remaining)
        for run in list(self._runs.values()):
            if run.task is not None and not run.completing:
                run.stopping = True
                run.task.cancel()
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=10)

    @property
    def in_flight(self) -> int:
        """Messages whose batch is being claimed, run or settled."""
        return self._messages_in_flight

    # -- processing ------------------------------------------------------------------------

    async def process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        """Claim, run and settle a batch of deliveries from one channel."""
        self._messages_in_flight += len(deliveries)
        try:
            await self._process(channel, deliveries)
        finally:
            self._messages_in_flight -= len(deliveries)

    async def _process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        handlers = self._channels.get(channel)
        if not handlers:
            for delivery in deliveries:
                self.stats.dead_lettered[Reason.NO_HANDLER.value] += 1
                await delivery.settle(_dead_letter(Reason.NO_HANDLER, f"no handler for {channel}"))
            return
        messages = [d.message for d in deliveries]
        plans: list[list[_Planned]] = []
        try:
            for handler in handlers:
                plans.append(await self._plan(handler, messages))
        except Exception:
            # A bug, not a message problem: give the batch back rather than leave it unsettled
            # (the keys claimed so far wait for their lease to lapse).
            logger.exception("unexpected error while claiming a batch; requeueing it")
            for outcome, observed in (planned for plan in plans for planned in plan):
                if asyncio.iscoroutine(outcome):
                    outcome.close()
                    if observed is not None and observed.run is not None:
                        await self._release(observed.run)
            for delivery in deliveries:
                await delivery.settle(
                    Settlement(Action.REQUEUE, detail="internal error", delay_s=5.0)
                )
            return
        # A few runner tasks work through the batch, not one task per message (a task per
        # message parked hundreds of them on the concurrency slots); a run whose handler is
        # done queues its completion and the runner moves on: the batch's settler concludes
        # the message once its completion statement commits.
        work = collections.deque(
            (delivery, [plan[i] for plan in plans]) for i, delivery in enumerate(deliveries)
        )
        completions = _Completions()
        batch = _Batch(work, completions)
        batch.runners = [
            asyncio.create_task(self._work_through(work, completions))
            for _ in range(min(len(work), self._runners))
        ]
        settler = asyncio.create_task(self._settle_completions(completions))
        self._inflight.update([*batch.runners, settler])
        self._batches.add(batch)
        try:
            awaited = 0
            while awaited < len(batch.runners):  # drain may add a runner meanwhile
                runners = batch.runners[awaited:]
                await asyncio.gather(*runners)
                awaited += len(runners)
            completions.close()
            await settler
        finally:
            completions.close()
            self._batches.discard(batch)
            self._inflight.difference_update([*batch.runners, settler])

    async def _work_through(
        self,
        work: collections.deque[tuple[Delivery, list[_Planned]]],
        completions: _Completions,
    ) -> None:
        while work:
            delivery, planned = work.popleft()
            await self._finish(delivery, planned, completions)

    async def _finish(
        self, delivery: Delivery, planned: list[_Planned], completions: _Completions
    ) -> None:
        """Await the delivery's outcomes (one per handler of its channel), then settle it.

        With one handler (the usual case) its run happens right here, in the runner's task;
        a completion still to commit goes to the batch's settler. Several handlers of a
        channel run side by side and their completions are awaited here.
        """
        try:
            if len(planned) == 1:
                outcome, observed = planned[0]
                settlement = await outcome
                if isinstance(settlement, _Pending):
                    completions.add(delivery, observed, settlement)
                    return
                if observed is not None:
                    self._observe(observed, settlement)
                settlements = [settlement]
            else:
                running = [asyncio.ensure_future(outcome) for outcome, _ in planned]
                settlements = []
                for future, (_, observed) in zip(running, planned, strict=True):
                    result = await future
                    settlement = (
                        await self._completed(result) if isinstance(result, _Pending) else result
                    )
                    if observed is not None:
                        self._observe(observed, settlement)
                    settlements.append(settlement)
        except Exception:
            # A bug, not a message problem: give the message back rather than lose it.
            logger.exception("unexpected error while processing; requeueing the message")
            settlements = [Settlement(Action.REQUEUE, detail="internal error", delay_s=5.0)]
        await self._conclude(delivery, settlements)

    async def _settle_completions(self, completions: _Completions) -> None:
        """Conclude a batch's messages as their completion statements commit, in order."""
        loop = asyncio.get_running_loop()
        while True:
            while completions.queue:
                delivery, observed, pending = completions.queue.popleft()
                try:
                    settlement = await self._completed(pending)
                    if observed is not None:
                        self._observe(observed, settlement)
                except Exception:
                    logger.exception("unexpected error while completing; requeueing the message")
                    settlement = Settlement(Action.REQUEUE, detail="internal error", delay_s=5.0)
                await self._conclude(delivery, [settlement])
            if completions.closed:
                return
            completions.wake = loop.create_future()
            await completions.wake

    async def _completed(self, pending: _Pending) -> Settlement:
        """The outcome of a run once its completion statement has committed (or failed)."""
        handler = pending.handler
        try:
            done = await pending.done
        except StoreError as exc:
            logger.warning("claim store unavailable, requeueing: %s", exc)
            return Settlement(Action.REQUEUE, detail=str(exc), delay_s=1.0)
        if not done:
            self.stats.fenced += 1
            self.stats.lease_lost += 1
            return Settlement(Action.DEFER, delay_s=handler.lease_s / 3, detail="lease lost")
        if self._hooks["completed"]:
            await self._run_hooks("completed", pending.message, pending.fence)
        self.stats.completed += 1
        return Settlement(Action.ACK, result=pending.result)

    async def _conclude(self, delivery: Delivery, settlements: list[Settlement]) -> None:
        """Settle the delivery with the most severe of its handlers' outcomes."""
        settlement = (
            settlements[0]
            if len(settlements) == 1
            else max(settlements, key=lambda s: _SEVERITY[s.action])
        )
        if settlement.action is Action.DEAD_LETTER and settlement.reason is not None:
            self.stats.dead_lettered[settlement.reason.value] += 1
        elif settlement.action is Action.DEFER:
            self.stats.deferred += 1
        elif settlement.action is Action.REQUEUE:
            self.stats.requeued += 1
        try:
            settled = await delivery.settle(settlement)
        except Exception:
            logger.exception("could not settle a message; the broker will deliver it again")
            return
        if settled and settlement.action is Action.DEAD_LETTER:
            failed = [
                Fence(s.scope, s.key, s.token)
                for s in settlements
                if s.failed_claim
                and s.scope is not None
                and s.key is not None
                and s.token is not None
            ]
            if failed:
                try:
                    await self.store.mark_dead_lettered(failed)
                except StoreError as exc:
                    # Harmless: a later copy of the message is dead-lettered once more.
                    logger.warning("could not record dead letters as sent: %s", exc)

    async def _plan(self, handler: Handler, messages: Sequence[Message]) -> list[_Planned]:
        """Claim every message's key in one statement; return each message's outcome.

        An outcome is a coroutine that a runner task runs (or a settled future); the
        first of a key that the batch holds twice is a task of its own, which the second
        awaits before it claims the key again.
        """
        outcomes: list[_Planned | None] = [None] * len(messages)
        first_of: dict[tuple[str, str], int] = {}
        requests: list[tuple[int, ClaimRequest]] = []
        repeats: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            try:
                scope = handler.scope_of(message)
                if not scope:
                    raise KeyMissing("the message has no tenant where the handler's scope looks")
                key = derive_key(handler.key_func, message)
                check_claimable(scope, key)
            except InvalidKey as exc:
                outcomes[i] = (_ready(_dead_letter(Reason.INVALID_KEY, str(exc))), None)
                continue
            except KeyMissing as exc:
                outcomes[i] = (_ready(_dead_letter(Reason.MISSING_KEY, str(exc))), None)
                continue
            except InvalidPayload as exc:
                outcomes[i] = (_ready(_dead_letter(Reason.INVALID_PAYLOAD, str(exc))), None)
                continue
            if (scope, key) in first_of:
                repeats.append((i, first_of[(scope, key)]))
                continue
            first_of[(scope, key)] = i
            requests.append((i, ClaimRequest(scope, key, message.payload_hash)))

        started = time.perf_counter()
        try:
            claims = await self._claim(handler, [request for _, request in requests])
            self.observer.claimed(handler.name, time.perf_counter() - started, len(requests))
        except StoreError as exc:
            logger.warning("claim failed, requeueing %d messages: %s", len(messages), exc)
            requeue = Settlement(Action.REQUEUE, detail=str(exc), delay_s=1.0)
            return [outcome or (_ready(requeue), None) for outcome in outcomes]
        awaited = {first for _, first in repeats}
        for (i, request), claim in zip(requests, claims, strict=True):
            # Held from now on: heartbeated while it waits for a runner, given back at a stop.
            held = self._hold(handler, claim) if claim.owned else None
            settle: Awaitable[_Outcome] = self._settle_claim(handler, messages[i], request, claim)
            if i in awaited:
                settle = self._spawn(settle)
            outcomes[i] = (settle, _Observed(handler, messages[i], request, started, held))
        for i, first in repeats:
            first_outcome = outcomes[first]
            after = self._after(first_outcome[0] if first_outcome else None, handler, messages[i])
            request = ClaimRequest(handler.scope_of(messages[i]) or "", "", b"")
            outcomes[i] = (after, _Observed(handler, messages[i], request, started))
        return [outcome for outcome in outcomes if outcome is not None]

    def _observe(self, observed: _Observed, settlement: Settlement) -> None:
        handler, message, request = observed.handler, observed.message, observed.request
        key = request.key or settlement.key or derive_key(handler.key_func, message)
        self.observer.settled(
            handler.name, request.scope, key, message, settlement, observed.started
        )

    async def _claim(self, handler: Handler, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim through the handler's batcher (one statement for many concurrent batches)."""
        if not requests:
            return []
        claimer = self._claimers.get(handler.name)
        if claimer is None:

            async def flush(batch: Sequence[ClaimRequest]) -> list[Claim]:
                return await self._claim_distinct(handler, batch)

            claimer = self._claimers[handler.name] = Batcher(flush)
        return await claimer.submit_many(requests)

    async def _claim_distinct(
        self, handler: Handler, requests: Sequence[ClaimRequest]
    ) -> list[Claim]:
        """Claim a flush of requests; a key that two batches share goes in a later statement
        (one statement cannot claim a key twice), where it meets the first one's claim."""
        claims: list[Claim | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        while todo:
            seen: set[tuple[str, str]] = set()
            now: list[int] = []
            later: list[int] = []
            for i in todo:
                ident = (requests[i].scope, requests[i].key)
                (later if ident in seen else now).append(i)
                seen.add(ident)
            got = await self.store.claim_batch(
                [requests[i] for i in now], lease_s=handler.lease_s, retention_s=handler.retention_s
            )
            for i, claim in zip(now, got, strict=True):
                claims[i] = claim
            todo = later
        return [claim for claim in claims if claim is not None]

    def _spawn(self, coro: Any) -> asyncio.Task[_Outcome]:
        task: asyncio.Task[_Outcome] = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    async def _after(
        self, first: Awaitable[_Outcome] | None, handler: Handler, message: Message
    ) -> _Outcome:
        """A second delivery of a key in the same batch: wait for the first, then claim."""
        if first is not None:
            outcome = await asyncio.shield(asyncio.ensure_future(first))
            if isinstance(outcome, _Pending):  # wait for its completion to commit
                with contextlib.suppress(Exception):
                    await asyncio.shield(outcome.done)
        if self._stopping:
            return Settlement(Action.REQUEUE, detail="worker stopping")
        scope = handler.scope_of(message) or ""
        request = ClaimRequest(scope, derive_key(handler.key_func, message), message.payload_hash)
        try:
            [claim] = await self.store.claim_batch(
                [request], lease_s=handler.lease_s, retention_s=handler.retention_s
            )
        except StoreError as exc:
            return Settlement(Action.REQUEUE, detail=str(exc), delay_s=1.0)
        return await self._settle_claim(handler, message, request, claim)

    async def _settle_claim(
        self, handler: Handler, message: Message, request: ClaimRequest, claim: Claim
    ) -> _Outcome:
        """Decide what a claim's answer means, and run the handler when the key is ours."""
        for _ in range(RECLAIM_TRIES):
            if claim.owned or claim.status is not None or claim.refused is not None:
                break
            # The row vanished (released, cleaned up) or was committed by a concurrent claim
            # after our statement's snapshot: ask again.
            await asyncio.sleep(0.01)
            try:
                [claim] = await self.store.claim_batch(
                    [request], lease_s=handler.lease_s, retention_s=handler.retention_s
                )
            except StoreError as exc:
                return Settlement(Action.REQUEUE, detail=str(exc), delay_s=1.0)
        if claim.owned:
            return await self._run(handler, message, claim)
        if claim.refused is not None:
            return _dead_letter(Reason.INVALID_KEY, claim.refused)
        if claim.same_payload is False:
            self.stats.conflicts += 1
            logger.warning(
                "key conflict: %s/%s was used before with another payload",
                claim.scope,
                claim.key,
                extra={
                    "handler": handler.name,
                    "scope": claim.scope,
                    "key": claim.key,
                    "message_id": message.message_id,
                    "attempt": message.attempt,
                    "outcome": "conflict",
                },
            )
            return _dead_letter(
                Reason.KEY_CONFLICT,
                f"key {claim.key!r} was first used with another payload (status {claim.status})",
                claim,
            )
        if claim.status == "failed" and not claim.dead_lettered:
            # The worker that failed this key died before its dead letter was confirmed: send it
            # again (at least once: the dead-letter queue may then hold it twice).
            detail = (claim.error or "").split(": ", 1)[-1]
            return _dead_letter(_reason_of(claim.error), detail, claim, failed_claim=True)
        if claim.status in ("completed", "failed"):
            self.stats.duplicates += 1
            return Settlement(Action.ACK, duplicate=True, result=claim.result)
        # In progress elsewhere (or just expired): look again later.
        delay = min(self._max_defer_s, handler.lease_s / 3 * 2 ** (message.attempt - 1))
        return Settlement(Action.DEFER, delay_s=delay, detail="key in progress elsewhere")

    def _hold(self, handler: Handler, claim: Claim) -> _Run:
        """Record a claim of ours, from now until its outcome.

        A take-over means a worker died holding this key. Its first run here happens alone
        and is counted just before it starts, so that if this message is what kills workers,
        only it is charged for the crash, not the messages that were claimed beside it.
        A key handed back by a worker that stopped is counted the same way but need not
        run alone: no crash is in its history.
        """
        assert claim.token is not None
        run = _Run(
            fence=Fence(claim.scope, claim.key, claim.token),
            lease_s=handler.lease_s,
            task=None,
            attempt=claim.attempts,
            counted=not (claim.taken_over or claim.handed_back),
            taken_over=claim.taken_over,
        )
        self._runs[(claim.scope, claim.key)] = run
        return run

    async def _release(self, run: _Run) -> None:
        """Forget a held claim that will not run, giving it back at once."""
        fence = run.fence
        if self._runs.get((fence.scope, fence.key)) is run:
            del self._runs[(fence.scope, fence.key)]
            await self._give_back(run)

    async def _run(self, handler: Handler, message: Message, claim: Claim) -> _Outcome:
        assert claim.token is not None
        task = asyncio.current_task()
        assert task is not None
        run = self._runs.get((claim.scope, claim.key))
        if run is None or run.fence.token != claim.token or run.task is not None:
            run = self._hold(handler, claim)  # claimed again after the batch's claim
        fence = run.fence
        if run.lost:  # taken over while it waited for a runner
            self._runs.pop((fence.scope, fence.key), None)
            self.stats.lease_lost += 1
            return Settlement(Action.DEFER, delay_s=handler.lease_s / 3, detail="lease lost")
        if self._stopping:
            await self._release(run)
            return Settlement(Action.REQUEUE, detail="worker stopping")
        run.task = task
        if claim.taken_over:
            self.stats.taken_over += 1
        try:
            try:
                payload = handler.decode(message)
            except InvalidPayload as exc:
                return await self._give_up(handler, fence, Reason.INVALID_PAYLOAD, str(exc))
            return await self._attempts(handler, message, payload, run)
        except asyncio.CancelledError:
            if not (run.lost or run.stopping):
                raise
            task.uncancel()
            if run.lost:
                self.stats.lease_lost += 1
                _log(handler, message, run).warning(
                    "lease lost to another worker; this run's writes were rolled back"
                )
                return Settlement(Action.DEFER, delay_s=handler.lease_s / 3, detail="lease lost")
            await self._give_back(run)
            return Settlement(Action.REQUEUE, detail="worker stopping")
        finally:
            self._runs.pop((fence.scope, fence.key), None)

    async def _attempts(
        self, handler: Handler, message: Message, payload: Any, run: _Run
    ) -> _Outcome:
        """Run the handler until it succeeds, fails for good, or runs out of attempts.

        tenacity's schedule (wait, before_sleep) without its per-call set-up, which cost more
        than the rest of a no-op run; a retry is rare, a first attempt is not. The loop runs in
        this frame: every frame between a run and its runner task costs at each resume.
        """
        fence = run.fence
        number = 0
        try:
            while True:
                number += 1
                try:
                    result = await self._attempt(handler, message, payload, run)
                    break
                except Exception as exc:
                    if not _transient(handler, exc) or run.attempt >= handler.max_attempts:
                        raise
                    await self._before_retry(handler, message, run, number, exc)
        except LeaseLost:
            self.stats.lease_lost += 1
            return Settlement(Action.DEFER, delay_s=handler.lease_s / 3, detail="lease lost")
        except StoreError as exc:
            _log(handler, message, run).warning("claim store unavailable, requeueing: %s", exc)
            return Settlement(Action.REQUEUE, detail=str(exc), delay_s=1.0)
        except _CrashLoop as exc:
            return await self._give_up(handler, fence, Reason.MAX_ATTEMPTS, str(exc))
        except Reject as exc:
            return await self._give_up(handler, fence, Reason.REJECTED, exc.reason)
        except Exception as exc:
            if _transient(handler, exc):
                detail = f"{run.attempt} attempts, last: {_describe(exc)}"
                return await self._give_up(handler, fence, Reason.MAX_ATTEMPTS, detail)
            return await self._give_up(handler, fence, Reason.HANDLER_ERROR, _describe(exc))
        if isinstance(result, _Pending):
            return result
        self.stats.completed += 1
        return Settlement(Action.ACK, result=result)

    async def _before_retry(
        self, handler: Handler, message: Message, run: _Run, number: int, exc: Exception
    ) -> None:
        """Record the failed attempt (fenced), then wait out the backoff before the next."""
        self.stats.retried += 1
        if isinstance(exc, Retry) and exc.delay_s is not None:
            delay = float(exc.delay_s)
        else:
            state = RetryCallState(None, None, (), {})  # type: ignore[arg-type]  # no retrier
            state.attempt_number = number
            state.set_exception((type(exc), exc, exc.__traceback__))
            backoff = wait_exponential_jitter(
                multiplier=handler.backoff_s, max=handler.max_backoff_s, jitter=handler.backoff_s
            )
            delay = float(backoff(state))
        _log(handler, message, run).warning(
            "attempt %d of %d failed (%s); retrying",
            run.attempt,
            handler.max_attempts,
            _describe(exc),
        )
        attempt = await self.store.record_attempt(
            run.fence, attempt=run.attempt + 1, error=_describe(exc), lease_s=handler.lease_s
        )
        if attempt is None:
            raise LeaseLost()
        run.attempt = attempt  # the lines of the next attempt carry its number
        await asyncio.sleep(delay)

    async def _attempt(
        self, handler: Handler, message: Message, payload: Any, run: _Run
    ) -> str | _Pending:
        """One run of the handler, then its completion, atomically with its ctx.db writes.

        A run that wrote nothing through ctx.db queues its completion for the next batched
        statement and returns it pending; the batch's settler concludes it after the commit.
        """
        fence = run.fence
        db = Database(self.store.pool) if handler.takes_context else None
        # The first run after a take-over (not counted yet) runs alone.
        isolate = self._isolation if run.taken_over and not run.counted else None
        try:
            if isolate is not None:
                await isolate.acquire()
            try:
                async with self._slots:
                    run.started = True
                    if not run.counted:
                        await self._count_take_over(handler, run)
                        run.counted = True
                    if self._hooks["claimed"]:
                        await self._run_hooks("claimed", message, fence)
                    if db is None:
                        call = handler.fn(payload)
                    else:
                        ctx = Context(
                            key=fence.key,
                            scope=fence.scope,
                            attempt=run.attempt,
                            message=message,
                            db=db,
                            logger=_log(handler, message, run),
                        )
                        call = handler.fn(payload, ctx)
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
            result = encode_result(value)
            if self._hooks["handled"]:
                await self._run_hooks("handled", message, fence)
            run.completing = True
            if db is not None and db.started:
                done = await self._complete_in(db, fence, result, handler.retention_s)
                if not done:
                    self.stats.fenced += 1
                    raise LeaseLost()
            else:
                queued = self._completer.submit_nowait((fence, result, handler.retention_s))
                return _Pending(handler, message, fence, result, queued)
            if self._hooks["completed"]:
                await self._run_hooks("completed", message, fence)
            return result
        except BaseException:
            run.completing = False  # the next attempt may be cancelled again
            raise
        finally:
            # A run that completed stays `completing`: a heartbeat that read the leases before
            # the completion committed must not take the finished run for a lost one.
            if db is not None:
                await db.close()

    async def _complete_in(
        self, db: Database, fence: Fence, result: str, retention_s: float
    ) -> bool:
        """Complete inside the handler's transaction and commit; a COMMIT that fails is the
        store's failure (the message is requeued), not the handler's: whether it committed is
        unknown, and the claim settles it (a duplicate, or a take-over after the lease)."""
        done = await self.store.complete([(fence, result, retention_s)], conn=await db.connection())
        if not done:
            return False
        try:
            await db.commit()
        except asyncpg.IntegrityConstraintViolationError:
            raise  # a deferred constraint the handler's writes broke: the handler's error
        except Exception as exc:
            raise StoreError(f"the commit failed: {_describe(exc)}") from exc
        return True

    async def _count_take_over(self, handler: Handler, run: _Run) -> None:
        """Count the start of a taken-over key's run; too many starts is a crash loop."""
        attempt = await self.store.record_attempt(
            run.fence, attempt=run.attempt + 1, error=None, lease_s=handler.lease_s
        )
        if attempt is None:
            raise LeaseLost()
        run.attempt = attempt
        if attempt > handler.max_attempts:
            raise _CrashLoop(
                f"started {attempt - 1} times without finishing (max_attempts="
                f"{handler.max_attempts}): its workers died or lost the database"
            )

    async def _run_hooks(self, stage: str, message: Message, fence: Fence) -> None:
        for hook in self._hooks[stage]:
            await hook(stage, message, fence.scope, fence.key)

    async def _complete_batch(self, items: Sequence[tuple[Fence, str, float]]) -> list[bool]:
        done = await self.store.complete(items)
        return [(fence.scope, fence.key) in done for fence, _, _ in items]

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
                fence, error=f"{reason}: {detail}"[:1000], retention_s=handler.retention_s
            )
        except StoreError as exc:
            logger.warning(
                "could not mark %s/%s failed, requeueing: %s", fence.scope, fence.key, exc
            )
            return Settlement(Action.REQUEUE, detail=str(exc), delay_s=1.0)
        if not recorded:  # another worker owns the key now; let its outcome decide
            self.stats.lease_lost += 1
            return Settlement(Action.DEFER, delay_s=handler.lease_s / 3, detail="lease lost")
        return _dead_letter(reason, detail, fence, failed_claim=True)

    async def _give_back(self, run: _Run) -> None:
        """Hand the key back at a graceful stop. The interrupted attempt is uncounted only if
        it was counted; a dead worker's key whose run never finished keeps its crash history
        (not marked handed back), so its next run still happens alone."""
        fence = run.fence
        try:
            await self.store.give_back(
                fence,
                attempt=run.attempt if run.counted else None,
                handed_back=not run.taken_over,
            )
        except StoreError as exc:
            logger.warning("could not give back %s/%s: %s", fence.scope, fence.key, exc)

    # -- background work -------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            runs = [run for run in self._runs.values() if not run.completing]
            if not runs:
                continue
            try:
                ours = await self.store.heartbeat([(run.fence, run.lease_s) for run in runs])
            except StoreError as exc:
                logger.warning("heartbeat failed (leases may lapse): %s", exc)
                continue
            for run in runs:
                key = (run.fence.scope, run.fence.key)
                if key not in ours and not run.completing and self._runs.get(key) is run:
                    run.lost = True
                    if run.task is not None:
                        run.task.cancel()

    async def _gc_loop(self) -> None:
        assert self._gc_interval_s
        while True:
            await asyncio.sleep(self._gc_interval_s)
            try:
                deleted = await self.store.gc()
            except StoreError as exc:
                logger.warning("clean-up failed: %s", exc)
                continue
            if deleted:
                self.stats.gc_deleted += deleted
                logger.info("clean-up removed %d expired claims", deleted)


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, TimeoutError):
        return "TimeoutError: handler timed out"
    text = storable_text(str(exc), 300)
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


@functools.cache
def _handler_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"dedupe.handler.{name}")


def _log(handler: Handler, message: Message, run: _Run) -> logging.LoggerAdapter[logging.Logger]:
    """The handler's logger with the message's scope, key, id and attempt on every line."""
    return logging.LoggerAdapter(
        _handler_logger(handler.name),
        {
            "handler": handler.name,
            "scope": run.fence.scope,
            "key": run.fence.key,
            "message_id": message.message_id,
            "attempt": run.attempt,
        },
    )


def _transient(handler: Handler, exc: BaseException) -> bool:
    """Whether the handler's error is worth another attempt."""
    if isinstance(exc, Retry):
        return True
    return isinstance(exc, handler.retry_on) and not isinstance(exc, DedupeError)


def _ready(settlement: Settlement) -> asyncio.Future[Settlement]:
    future: asyncio.Future[Settlement] = asyncio.get_running_loop().create_future()
    future.set_result(settlement)
    return future


__all__ = ["ACK", "Processor", "Stats", "encode_result"]  # encode_result: from .values
