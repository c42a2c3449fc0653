"""The processing pipeline: a batch of deliveries claimed, run and concluded; its lifecycle.

A key's way: the transport hands a batch to `Processor.process`; each message's claim request is
derived once per handler (dedupe.claims.verdicts.request_for) and claimed with the batch's others
in a shared statement (dedupe.claims.verdicts.Claims); the claims that are ours are held and
heartbeated (dedupe.claims.leases) until a runner task runs them (dedupe.pipeline.runs); every
outcome is concluded into the one settlement the delivery gets (dedupe.pipeline.outcomes).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dedupe.app import App, Handler
from dedupe.claims.leases import Lease, Leases
from dedupe.claims.records import ClaimRequest, KeyId, Reason
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import (
    Claims,
    InFlight,
    Ours,
    Terms,
    Unavailable,
    Unclaimable,
    Verdict,
    request_for,
)
from dedupe.effects.outbox import Relay
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.pipeline import one_transaction as onetx
from dedupe.pipeline.observers import Observer, Observers
from dedupe.pipeline.outcomes import (
    REQUEUE_INTERNAL,
    REQUEUE_STOPPING,
    REQUEUE_WITHDRAWN,
    Completions,
    Outcome,
    Outcomes,
    Pending,
    Ticket,
    dead_letter,
    store_unavailable,
)
from dedupe.pipeline.runs import Runner
from dedupe.pipeline.stats import Stats
from dedupe.transport import Delivery, Publisher, Settlement

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class _Planned:
    """A message's outcome under one handler: settled from its verdict, or a run to await."""

    outcome: Awaitable[Outcome] | None  # None: settled
    ticket: Ticket | None = None  # None: settled before any claim (no key)
    lease: Lease | None = None  # our claim, held until a runner takes it
    settled: Settlement | None = None  # a verdict's outcome that needs no run


_Work = collections.deque[tuple[Delivery, list[_Planned]]]


@dataclass(eq=False)
class _Batch:
    """One process() call's queue of deliveries and the runner tasks working through it."""

    work: _Work
    completions: Completions
    runners: list[asyncio.Task[None]] = field(default_factory=list)


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
        park_after_s: float = 5.0,
        heartbeat_s: float | None = None,
        observers: Sequence[Observer] = (),
        publisher: Publisher | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.stats = Stats()
        self.observer = Observers(observers)
        self.claims = Claims(store)
        self.leases = Leases(store)
        self.outcomes = Outcomes(store, self.stats, self.observer, max_defer_s=max_defer_s)
        self.runner = Runner(
            app,
            store,
            self.leases,
            self.stats,
            self.observer,
            concurrency=concurrency,
            park_after_s=park_after_s,
        )
        # First deliveries of one_transaction=True handlers, within the same concurrency.
        self.one_transaction = onetx.OneTransaction(
            store,
            self.stats,
            self.observer,
            self.runner.hooks,
            self.runner.slots,
            stopping=lambda: self.runner.stopping,
            park_after_s=park_after_s,
        )
        # The outbox relay (ctx.publish) runs in every worker that can publish.
        self.relay = Relay(store.pool, publisher) if publisher is not None else None
        if self.relay is not None:
            self.runner.on_published = self.relay.wake
            self.one_transaction.on_published = self.relay.wake
        self._channels = app.channels
        self._runners = concurrency
        self._batches: set[_Batch] = set()
        self._gc_interval_s = gc_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[Any]] = set()
        self._messages_in_flight = 0
        leases = [h.lease_s for h in app.handlers.values()] or [30.0]
        self._heartbeat_s = heartbeat_s or min(leases) / 3

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Processor:
        if self.relay is not None:
            await self.relay.__aenter__()
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
        if self.relay is not None:
            await self.relay.__aexit__(None, None, None)

    async def drain(self, *, timeout_s: float) -> None:
        """Give back at once the claims no handler runs yet (queued behind others, waiting for
        a slot), wait for the runs under way; past the timeout, give their keys back too. The
        deliveries given back are requeued."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.runner.stopping = True
        self.leases.stop_waiting()
        # The batches' queued deliveries are concluded by a runner of their own each (a claim
        # of ours is given back, nothing runs), not left behind the runners' current work.
        for batch in self._batches:
            if batch.work:
                stopper = asyncio.create_task(
                    self._work_through(batch.work, batch.completions), name="dedupe-give-back"
                )
                batch.runners.append(stopper)
                self._inflight.add(stopper)
        # Batches that were still claiming when the wait began start their runs later (up to
        # two per partition on Kafka): wait for those too, within the same deadline.
        while self._inflight and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._inflight), timeout=remaining)
        self.leases.stop_running()
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=10)

    @property
    def in_flight(self) -> int:
        """Messages whose batch is being claimed, run or concluded."""
        return self._messages_in_flight

    # -- a batch ---------------------------------------------------------------------------

    async def process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        """Claim, run and conclude a batch of deliveries from one channel."""
        self._messages_in_flight += len(deliveries)
        try:
            await self._process(channel, deliveries)
        finally:
            self._messages_in_flight -= len(deliveries)

    async def _process(self, channel: str, deliveries: Sequence[Delivery]) -> None:
        handlers = self._channels.get(channel)
        if handlers and any(h.one_transaction for h in handlers):
            deliveries = await self._one_transaction(handlers, deliveries)
            if not deliveries:
                return
        if not handlers:
            for delivery in deliveries:
                await self.outcomes.conclude(
                    delivery, [dead_letter(Reason.NO_HANDLER, f"no handler for {channel}")]
                )
            return
        started = time.perf_counter()
        plans: list[list[_Planned]] = []
        try:
            for handler in handlers:
                plans.append(await self._plan(handler, deliveries, started))
        except Exception:
            # A bug, not a message problem: give the batch back rather than leave it unsettled.
            logger.exception("unexpected error while claiming a batch; requeueing it")
            for planned in (planned for plan in plans for planned in plan):
                if planned.outcome is not None and asyncio.iscoroutine(planned.outcome):
                    planned.outcome.close()
                    if planned.lease is not None:
                        await self.leases.release(planned.lease)
            for delivery in deliveries:
                await self.outcomes.conclude(delivery, [REQUEUE_INTERNAL])
            return
        # A message whose every outcome came with its verdict (a duplicate, a conflict, a key
        # in flight elsewhere, no key) is settled right here, from its claim row: no runner,
        # task or future of its own. The others go to a few runner tasks that work through
        # the batch, not one task per message (a task per message parked hundreds of them on
        # the concurrency slots); a run whose handler is done queues its completion and the
        # runner moves on: the batch's concluder finishes the message once its completion
        # statement commits.
        work: _Work = collections.deque()
        settled: list[tuple[Delivery, list[_Planned]]] = []
        for i, delivery in enumerate(deliveries):
            mine = [plan[i] for plan in plans]
            if all(p.outcome is None for p in mine):
                settled.append((delivery, mine))
                continue
            work.append((delivery, mine))
        if not work:
            await self._settle(settled)
            return
        batch = _Batch(work, Completions())
        batch.runners = [
            asyncio.create_task(self._work_through(work, batch.completions))
            for _ in range(min(len(work), self._runners))
        ]
        concluder = asyncio.create_task(self._conclude_completions(batch.completions))
        self._inflight.update([*batch.runners, concluder])
        self._batches.add(batch)
        try:
            await self._settle(settled)
            awaited = 0
            while awaited < len(batch.runners):  # drain may add a runner meanwhile
                runners = batch.runners[awaited:]
                await asyncio.gather(*runners)
                awaited += len(runners)
            batch.completions.close()
            await concluder
        finally:
            batch.completions.close()
            self._batches.discard(batch)
            self._inflight.difference_update([*batch.runners, concluder])

    async def _one_transaction(
        self, handlers: Sequence[Handler], deliveries: Sequence[Delivery]
    ) -> Sequence[Delivery]:
        """Run the batch's first deliveries of a one_transaction=True handler in one
        transaction each, side by side within the handler concurrency (each on a pooled
        connection of its own), and conclude those that committed; return the others, in their
        order, for the two-commit path (dedupe.pipeline.one_transaction)."""
        first = self.one_transaction
        if len(handlers) > 1:  # one transaction cannot hold several handlers' outcomes
            first.fall_back(onetx.SHARED_CHANNEL, len(deliveries))
            return deliveries
        if self.runner.stopping:
            first.fall_back(onetx.STOPPING, len(deliveries))
            return deliveries
        [handler] = handlers
        started = time.perf_counter()
        runs: dict[int, Ticket] = {}
        seen: set[KeyId] = set()
        for i, delivery in enumerate(deliveries):
            message = delivery.message
            if not onetx.first_delivery(message):
                first.fall_back(onetx.REDELIVERY)
                continue
            request = _request(handler, message)
            if isinstance(request, Unclaimable):
                first.fall_back(onetx.NO_KEY)
                continue
            if request.ident in seen:
                first.fall_back(onetx.REPEAT)
                continue
            seen.add(request.ident)
            runs[i] = Ticket(handler, message, request, started, delivery)
        if not runs:
            return deliveries

        async def run(delivery: Delivery, ticket: Ticket) -> bool:
            try:
                outcome = await first.run(ticket)
                if outcome == onetx.LOCK_TIMEOUT:
                    # Another transaction holds the key (bounded by its own timeouts): the
                    # two-commit claim would wait on it unbounded; it is in flight elsewhere.
                    outcome = self.outcomes.of(ticket, InFlight())
            except Exception:
                logger.exception("unexpected error in a one-transaction run; requeueing it")
                outcome = REQUEUE_INTERNAL
            if isinstance(outcome, str):
                return False
            self.outcomes.observe(ticket, outcome)
            await self.outcomes.conclude(delivery, [outcome])
            return True

        tasks = {i: self._spawn(run(deliveries[i], ticket)) for i, ticket in runs.items()}
        await asyncio.wait(tasks.values())
        return [
            delivery
            for i, delivery in enumerate(deliveries)
            if i not in tasks or not tasks[i].result()
        ]

    async def _plan(
        self, handler: Handler, deliveries: Sequence[Delivery], started: float
    ) -> list[_Planned]:
        """Claim every message's key in one statement; return each message's outcome to await.

        The first of a key that the batch holds twice is a task of its own, which the second
        awaits before it claims the key again.
        """
        planned: list[_Planned | None] = [None] * len(deliveries)
        tickets: list[tuple[int, Ticket]] = []
        first_of: dict[KeyId, int] = {}
        repeats: list[tuple[int, int, Ticket]] = []
        for i, delivery in enumerate(deliveries):
            message = delivery.message
            request = _request(handler, message)
            if isinstance(request, Unclaimable):
                planned[i] = _Planned(None, settled=dead_letter(request.reason, request.detail))
                continue
            ticket = Ticket(handler, message, request, started, delivery)
            ident = request.ident
            if ident in first_of:
                repeats.append((i, first_of[ident], ticket))
                continue
            first_of[ident] = i
            tickets.append((i, ticket))

        began = time.perf_counter()
        terms = Terms(handler.lease_s, handler.retention_s)
        verdicts = await self.claims.claim(handler.name, terms, [t.request for _, t in tickets])
        if verdicts and isinstance(verdicts[0], Unavailable):
            logger.warning(
                "claim failed, requeueing %d messages: %s", len(deliveries), verdicts[0].error
            )
            requeue = store_unavailable(verdicts[0].error)
            return [p or _Planned(None, settled=requeue) for p in planned]
        self.observer.claimed(handler.name, time.perf_counter() - began, len(tickets))
        awaited = {first for _, first, _ in repeats}
        for (i, ticket), verdict in zip(tickets, verdicts, strict=True):
            if isinstance(verdict, Ours):
                # Held from now on: heartbeated while it waits for a runner, given back at a
                # stop.
                lease = self.leases.hold(verdict, lease_s=handler.lease_s)
                outcome: Awaitable[Outcome] = self.runner.run(ticket, verdict)
            elif i not in awaited:  # its outcome comes with the verdict
                planned[i] = _Planned(None, ticket, settled=self.outcomes.of(ticket, verdict))
                continue
            else:
                lease, outcome = None, _ready(self.outcomes.of(ticket, verdict))
            if i in awaited:
                outcome = self._spawn(outcome)
            planned[i] = _Planned(outcome, ticket, lease)
        for i, first, ticket in repeats:
            first_planned = planned[first]
            assert first_planned is not None
            planned[i] = _Planned(self._after(_awaitable(first_planned), ticket), ticket)
        return [p for p in planned if p is not None]

    async def _settle(self, settled: Sequence[tuple[Delivery, list[_Planned]]]) -> None:
        """Conclude the messages whose outcomes came with their verdicts."""
        for delivery, planned in settled:
            settlements: list[Settlement] = []
            try:
                for p in planned:
                    assert p.settled is not None
                    self.outcomes.observe(p.ticket, p.settled)
                    settlements.append(p.settled)
            except Exception:
                logger.exception("unexpected error while settling; requeueing the message")
                settlements = [REQUEUE_INTERNAL]
            await self.outcomes.conclude(delivery, settlements)

    async def _decide(self, ticket: Ticket, verdict: Verdict) -> Outcome:
        """Run the handler on a claim of ours; any other verdict has its outcome at once."""
        if isinstance(verdict, Ours):
            return await self.runner.run(ticket, verdict)
        return self.outcomes.of(ticket, verdict)

    async def _after(self, first: Awaitable[Outcome], ticket: Ticket) -> Outcome:
        """A second delivery of a key in the same batch: wait for the first, then claim."""
        outcome = await asyncio.shield(asyncio.ensure_future(first))
        if isinstance(outcome, Pending):  # wait for its completion to commit
            with contextlib.suppress(Exception):
                await asyncio.shield(outcome.done)
        if self.runner.stopping:
            return REQUEUE_STOPPING
        if ticket.withdrawn:
            return REQUEUE_WITHDRAWN
        handler = ticket.handler
        terms = Terms(handler.lease_s, handler.retention_s)
        return await self._decide(ticket, await self.claims.claim_one(terms, ticket.request))

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    # -- runners and the concluder ---------------------------------------------------------

    async def _work_through(self, work: _Work, completions: Completions) -> None:
        while work:
            delivery, planned = work.popleft()
            await self._finish(delivery, planned, completions)

    async def _finish(
        self, delivery: Delivery, planned: list[_Planned], completions: Completions
    ) -> None:
        """Await the delivery's outcomes (one per handler of its channel), then conclude it.

        With one handler (the usual case) its run happens right here, in the runner's task;
        a completion still to commit goes to the batch's concluder. Several handlers of a
        channel run side by side and their completions are awaited here.
        """
        try:
            if len(planned) == 1:
                outcome = planned[0].outcome
                assert outcome is not None  # settled ones never reach a runner
                settlement = await outcome
                if isinstance(settlement, Pending):
                    completions.add(delivery, settlement)
                    return
                self.outcomes.observe(planned[0].ticket, settlement)
                settlements = [settlement]
            else:
                running = [asyncio.ensure_future(_awaitable(p)) for p in planned]
                settlements = []
                for future, p in zip(running, planned, strict=True):
                    result = await future
                    settlement = (
                        await self.outcomes.completed(result, self.runner.hooks)
                        if isinstance(result, Pending)
                        else result
                    )
                    self.outcomes.observe(p.ticket, settlement)
                    settlements.append(settlement)
        except Exception:
            # A bug, not a message problem: give the message back rather than lose it.
            logger.exception("unexpected error while processing; requeueing the message")
            settlements = [REQUEUE_INTERNAL]
        await self.outcomes.conclude(delivery, settlements)

    async def _conclude_completions(self, completions: Completions) -> None:
        """Conclude a batch's messages as their completion statements commit, in order."""
        loop = asyncio.get_running_loop()
        while True:
            while completions.queue:
                delivery, pending = completions.queue.popleft()
                try:
                    settlement = await self.outcomes.completed(pending, self.runner.hooks)
                    self.outcomes.observe(pending.ticket, settlement)
                except Exception:
                    logger.exception("unexpected error while completing; requeueing the message")
                    settlement = REQUEUE_INTERNAL
                await self.outcomes.conclude(delivery, [settlement])
            if completions.closed:
                return
            completions.wake = loop.create_future()
            await completions.wake

    # -- background work -------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self.leases.beat()
            except Exception:  # a bug: log it, but never let the leases lapse for good
                logger.exception("heartbeat failed unexpectedly; trying again")

    async def _gc_loop(self) -> None:
        assert self._gc_interval_s
        while True:
            await asyncio.sleep(self._gc_interval_s)
            try:
                # One clean-up leader at a time (the advisory lock): None here is another's turn.
                cleaned = await self.store.gc()
            except StoreError as exc:
                logger.warning("clean-up failed: %s", exc)
                continue
            if cleaned is not None and (cleaned.claims or cleaned.outbox):
                self.stats.gc_deleted += cleaned.claims
                self.stats.outbox_gc_deleted += cleaned.outbox
                logger.info(
                    "clean-up removed %d expired claims and %d sent outbox rows",
                    cleaned.claims,
                    cleaned.outbox,
                )


def _request(handler: Handler, message: Message) -> ClaimRequest | Unclaimable:
    """The claim a message of `handler` asks for, or why it cannot be claimed."""
    return request_for(
        message,
        key_func=handler.key_func,
        scope_of=handler.scope_of,
        fingerprint=handler.fingerprint,
        keep_payload=handler.keep_payload,
    )


def _awaitable(planned: _Planned) -> Awaitable[Outcome]:
    if planned.outcome is not None:
        return planned.outcome
    assert planned.settled is not None
    return _ready(planned.settled)


def _ready(settlement: Settlement) -> asyncio.Future[Outcome]:
    future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    future.set_result(settlement)
    return future


__all__ = ["Processor"]
