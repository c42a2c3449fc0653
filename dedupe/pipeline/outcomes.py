"""What the transport is told: verdicts and runs become outcomes, a message's outcomes (one per
handler of its channel) are concluded into the one settlement its delivery gets, and counted
(in dedupe.pipeline.stats)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from dedupe.app import Handler
from dedupe.claims import conflict_records, conflicts
from dedupe.claims.records import ClaimRequest, Fence, Reason
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import storable_text
from dedupe.claims.verdicts import (
    Conflict,
    Duplicate,
    InFlight,
    Unavailable,
    Unclaimable,
    Unsent,
    Verdict,
)
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.pipeline.hooks import Hooks
from dedupe.pipeline.observers import Observer
from dedupe.pipeline.stats import Stats
from dedupe.transport import Action, Delivery, Settlement
from dedupe.transport import withdrawn as delivery_withdrawn

logger = logging.getLogger("dedupe.pipeline")

# Severity order used to combine the outcomes of several handlers of one channel.
_SEVERITY = {Action.ACK: 0, Action.DEFER: 1, Action.REQUEUE: 2, Action.DEAD_LETTER: 3}


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class Ticket:
    """One message under one handler: its claim request (the key, derived once) and when its
    batch began, carried to the outcome."""

    handler: Handler
    message: Message
    request: ClaimRequest
    started: float
    # The delivery that brought the message, asked whether the transport took it back.
    delivery: Delivery | None = field(default=None, compare=False, repr=False)

    @property
    def withdrawn(self) -> bool:
        """Whether the transport took the message's delivery back (a revoked Kafka
        partition): a claim whose handler has not started is then given back, not run."""
        return self.delivery is not None and delivery_withdrawn(self.delivery)


@dataclass(eq=False, slots=True)
class Pending:
    """A run whose handler is done and whose completion is queued for the next statement.

    The runner goes on to its next message instead of waiting for the commit; the batch's
    concluder finishes the message once `done` resolves (True: completed; False: fenced).
    """

    ticket: Ticket
    fence: Fence
    result: str
    done: asyncio.Future[list[bool]]  # [True]: completed; [False]: fenced


Outcome = Settlement | Pending


def dead_letter(
    reason: Reason, detail: str, fence: Fence | None = None, *, failed_claim: bool = False
) -> Settlement:
    return Settlement(
        Action.DEAD_LETTER,
        reason=reason,
        detail=storable_text(detail, 500),
        scope=fence.scope if fence else None,
        key=fence.key if fence else None,
        token=fence.token if fence else None,
        failed_claim=failed_claim,
    )


def lease_lost(handler: Handler) -> Settlement:
    return Settlement(Action.DEFER, delay_s=handler.lease_s / 3, detail="lease lost")


REQUEUE_INTERNAL = Settlement(Action.REQUEUE, detail="internal error", delay_s=5.0)
REQUEUE_STOPPING = Settlement(Action.REQUEUE, detail="worker stopping")
REQUEUE_WITHDRAWN = Settlement(Action.REQUEUE, detail="delivery withdrawn by the transport")


def store_unavailable(error: str) -> Settlement:
    return Settlement(Action.REQUEUE, detail=error, delay_s=1.0)


class Outcomes:
    """Outcomes of verdicts that need no run, and the conclusion of each delivery."""

    def __init__(
        self, store: ClaimStore, stats: Stats, observer: Observer, *, max_defer_s: float
    ) -> None:
        self.store = store
        self.stats = stats
        self.observer = observer
        self._max_defer_s = max_defer_s

    def of(self, ticket: Ticket, verdict: Verdict) -> Settlement:
        """The outcome of a verdict that is not ours to run."""
        handler, message = ticket.handler, ticket.message
        if isinstance(verdict, Duplicate):
            self.stats.duplicates += 1
            if verdict.reason is not None:  # failed for good: its fault reply again
                return Settlement(
                    Action.ACK, duplicate=True, failed_reason=verdict.reason, detail=verdict.error
                )
            return Settlement(Action.ACK, duplicate=True, result=verdict.result)
        if isinstance(verdict, InFlight):
            delay = min(self._max_defer_s, handler.lease_s / 3 * 2 ** (message.attempt - 1))
            return Settlement(Action.DEFER, delay_s=delay, detail="key in progress elsewhere")
        if isinstance(verdict, Conflict):
            return self._conflict(ticket, verdict)
        if isinstance(verdict, Unsent):
            # The worker that failed this key died before its dead letter was confirmed: send it
            # again (at least once: the dead-letter queue may then hold it twice).
            return dead_letter(verdict.reason, verdict.detail, verdict.fence, failed_claim=True)
        if isinstance(verdict, Unclaimable):
            return dead_letter(verdict.reason, verdict.detail)
        if isinstance(verdict, Unavailable):
            return store_unavailable(verdict.error)
        raise AssertionError(f"a verdict to run, not to settle: {verdict!r}")

    def _conflict(self, ticket: Ticket, verdict: Conflict) -> Settlement:
        request, handler = ticket.request, ticket.handler
        self.stats.conflicts += 1
        # Both fingerprints and what differs, for the dead letter, the history and the record.
        report = conflicts.report(
            request,
            ticket.message,
            handler.fingerprint,
            claimed_fingerprint=verdict.fingerprint,
            claimed_hash=verdict.payload_hash,
            claimed_payload=verdict.payload,
            keep_payload=handler.keep_payload,
        )
        logger.warning(
            "key conflict: %s/%s was used before with another payload",
            request.scope,
            request.key,
            extra={
                "handler": ticket.handler.name,
                "scope": request.scope,
                "key": request.key,
                "message_id": ticket.message.message_id,
                "attempt": ticket.message.attempt,
                "outcome": "conflict",
            },
        )
        return Settlement(
            Action.DEAD_LETTER,
            reason=Reason.KEY_CONFLICT,
            detail=storable_text(
                f"key {request.key!r} was first used with another payload "
                f"(status {verdict.status})",
                500,
            ),
            scope=request.scope,
            key=request.key,
            conflict=report,
        )

    async def completed(self, pending: Pending, hooks: Hooks) -> Settlement:
        """The outcome of a run once its completion statement has committed (or failed)."""
        handler = pending.ticket.handler
        try:
            [done] = await pending.done
        except StoreError as exc:
            logger.warning("claim store unavailable, requeueing: %s", exc)
            return store_unavailable(str(exc))
        if not done:
            self.stats.fenced += 1
            self.stats.lease_lost += 1
            return lease_lost(handler)
        if hooks.any("completed"):
            await hooks("completed", pending.ticket.message, pending.fence)
        self.stats.completed += 1
        return Settlement(Action.ACK, result=pending.result)

    def observe(self, ticket: Ticket | None, settlement: Settlement) -> None:
        if ticket is not None:
            self.observer.concluded(
                ticket.handler.name,
                ticket.request.scope,
                ticket.request.key,
                ticket.message,
                settlement,
                ticket.started,
            )

    async def conclude(self, delivery: Delivery, settlements: Sequence[Settlement]) -> None:
        """Settle the delivery with the most severe of its handlers' outcomes."""
        settlement = (
            settlements[0]
            if len(settlements) == 1
            else max(settlements, key=lambda s: _SEVERITY[s.action])
        )
        if settlement.action is Action.DEAD_LETTER:
            reports = [s.conflict for s in settlements if s.conflict is not None]
            if reports:  # rare: a statement of its own, committed before the broker hears
                settlement = await self._recorded(reports, settlement)
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
                if s.failed_claim and s.scope is not None and s.key is not None and s.token
            ]
            if failed:
                try:
                    await self.store.mark_dead_lettered(failed)
                except StoreError as exc:
                    # Harmless: a later copy of the message is dead-lettered once more.
                    logger.warning("could not record dead letters as sent: %s", exc)

    async def _recorded(
        self, reports: Sequence[conflicts.ConflictReport], settlement: Settlement
    ) -> Settlement:
        """The settlement of a conflicting message once its records have committed; a
        requeue when they could not be (the redelivery records them)."""
        try:
            await conflict_records.record(self.store.pool, reports)
        except StoreError as exc:
            logger.warning("requeueing a conflicting message: %s", exc)
            return store_unavailable(str(exc))
        return settlement


class Completions:
    """The pending completions of one batch, handed from its runners to its concluder, which
    finishes each message in the order its run ended."""

    __slots__ = ("closed", "queue", "wake")

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[Delivery, Pending]] = collections.deque()
        self.wake: asyncio.Future[None] | None = None
        self.closed = False

    def add(self, delivery: Delivery, pending: Pending) -> None:
        self.queue.append((delivery, pending))
        self._poke()

    def close(self) -> None:
        self.closed = True
        self._poke()

    def _poke(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


__all__ = [
    "REQUEUE_INTERNAL",
    "REQUEUE_STOPPING",
    "REQUEUE_WITHDRAWN",
    "Completions",
    "Outcome",
    "Outcomes",
    "Pending",
    "Ticket",
    "dead_letter",
    "lease_lost",
    "store_unavailable",
]
