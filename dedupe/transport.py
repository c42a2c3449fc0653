"""What the core tells a transport to do with a delivery, and what a transport must offer."""

from __future__ import annotations

import abc
import asyncio
import enum
import json
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dedupe.claims.conflicts import CONFLICT_HEADERS, ConflictReport
from dedupe.claims.records import Reason
from dedupe.claims.values import storable_text
from dedupe.message import Message


class Action(enum.StrEnum):
    ACK = "ack"  # outcome recorded (or a duplicate of one): acknowledge, never run again
    DEAD_LETTER = "dead_letter"  # move to <channel>.dlq with the reason in headers
    DEFER = "defer"  # someone else holds the key: deliver again after delay_s
    REQUEUE = "requeue"  # we stop (or the store is down): give it back to the broker


@dataclass(frozen=True, slots=True)
class Settlement:
    action: Action
    reason: Reason | None = None
    detail: str | None = None
    delay_s: float = 0.0
    duplicate: bool = False
    result: str | None = None  # the stored outcome (JSON), for transports with a reply path
    scope: str | None = None  # the claim concerned, carried into dead-letter headers
    key: str | None = None
    token: int | None = (
        None  # the claim's token (fences the record of a failed claim's dead letter)
    )
    # A dead letter of our own failed claim (not a conflict with someone else's): once the
    # transport has settled it, the claim records that its dead letter went out.
    failed_claim: bool = False
    # A key_conflict's report: both fingerprints and the diff, on the dead letter's headers.
    conflict: ConflictReport | None = None
    # A duplicate of a key that failed for good: its recorded reason and detail, for the fault
    # reply its request gets again (a dead letter carries them in `reason` and `detail`).
    failed_reason: Reason | None = None


ACK = Settlement(Action.ACK)

# The headers every transport puts on a dead letter (RabbitMQ: AMQP headers; Kafka: record
# headers), so that `dlq list|replay` and operators read one vocabulary on both brokers.
REASON_HEADER = "x-dedupe-reason"
DETAIL_HEADER = "x-dedupe-detail"
SCOPE_HEADER = "x-dedupe-scope"
KEY_HEADER = "x-dedupe-key"
DEAD_LETTER_HEADERS = (REASON_HEADER, DETAIL_HEADER, SCOPE_HEADER, KEY_HEADER, *CONFLICT_HEADERS)
# On a dead letter written without its body (the broker refused the whole copy, e.g. too
# large once our headers were added): why. Replay skips such a dead letter
# (dedupe.operations.replay).
BODY_DROPPED_HEADER = "x-dedupe-body-dropped"


# A request (RabbitMQ `reply_to`, Kafka `reply-to`) that ends without a result gets a fault
# reply, and its duplicates the same again: these headers and a small JSON body say so. A
# successful reply carries none of them (its body is the stored result, as before).
STATUS_HEADER = "x-dedupe-status"
FAULT_DETAIL_BYTES = 500
_INVALID = {Reason.INVALID_PAYLOAD, Reason.INVALID_KEY, Reason.MISSING_KEY, Reason.NO_HANDLER}


@dataclass(frozen=True, slots=True)
class FaultReply:
    """What a request that failed, was dead-lettered, conflicted or was invalid is told."""

    status: str  # failed | conflict | invalid
    reason: str
    detail: str

    def headers(self) -> dict[str, str]:
        return {STATUS_HEADER: self.status, REASON_HEADER: self.reason}

    def body(self) -> bytes:
        return json.dumps(
            {"status": self.status, "reason": self.reason, "detail": self.detail},
            ensure_ascii=False,
        ).encode()


def fault_reply(settlement: Settlement) -> FaultReply | None:
    """The fault reply a settlement owes its request, if any: a dead letter, or a duplicate of
    a key that failed for good."""
    if settlement.action is Action.DEAD_LETTER and settlement.reason is not None:
        reason, detail = settlement.reason, settlement.detail or ""
    elif settlement.failed_reason is not None:
        reason, detail = settlement.failed_reason, settlement.detail or ""
    else:
        return None
    if reason is Reason.KEY_CONFLICT:
        status = "conflict"
    elif reason in _INVALID:
        status = "invalid"
    else:
        status = "failed"
    return FaultReply(status, str(reason), storable_text(detail, FAULT_DETAIL_BYTES))


def reply_of(settlement: Settlement) -> tuple[bytes, dict[str, str]] | None:
    """What a request's caller is told, as (body, headers): the stored result (no headers of
    ours), or the fault reply; None when there is nothing to tell (a deferral, a requeue)."""
    if settlement.result is not None:
        return settlement.result.encode(), {}
    fault = fault_reply(settlement)
    return None if fault is None else (fault.body(), fault.headers())


# How many times a message was deferred through the broker (its next delivery's attempt is one
# more): RabbitMQ's delay queues and Kafka's retry topics carry it on the copy they hold.
DEFERRALS_HEADER = "x-dedupe-deferrals"

# (bound in seconds, label): the delay buckets of deferrals that go through the broker, shortest
# first (RabbitMQ: a delay queue per bucket; Kafka: a retry topic per bucket). A delay waits in
# the smallest bucket whose bound covers it; a longer one than the last bound, in the last.
DELAY_BUCKETS: tuple[tuple[float, str], ...] = (
    (5.0, "5s"),
    (30.0, "30s"),
    (120.0, "2m"),
    (600.0, "10m"),
    (3600.0, "1h"),
)


def delay_bucket(delay_s: float) -> tuple[float, str]:
    """The bucket (bound in seconds, label) a deferral of `delay_s` waits in: the smallest
    whose bound covers it, else the last."""
    return next((b for b in DELAY_BUCKETS if delay_s <= b[0]), DELAY_BUCKETS[-1])


def dlq_name(channel: str) -> str:
    """The dead-letter queue (RabbitMQ) or topic (Kafka) of a channel."""
    return f"{channel}.dlq"


def dead_letter_headers(settlement: Settlement) -> dict[str, str]:
    """Why a message was dead-lettered and which claim it concerns, as headers."""
    headers = {
        REASON_HEADER: str(settlement.reason),
        DETAIL_HEADER: settlement.detail or "",
    }
    if settlement.scope is not None and settlement.key is not None:
        headers[SCOPE_HEADER] = settlement.scope
        headers[KEY_HEADER] = settlement.key
    if settlement.conflict is not None:
        headers.update(settlement.conflict.dead_letter_headers())
    return headers


class Delivery(Protocol):
    """A message plus the means to settle it with the broker.

    A delivery may also say that the transport took it back: a `withdrawn` attribute that
    turns true (a Kafka partition revoked in a rebalance) once the worker should run nothing
    more of it. Optional (`withdrawn(delivery)` reads it; without it, never): a claimed
    delivery that is withdrawn before its handler starts is given back and requeued, as at a
    stop, rather than run; a run under way is not interrupted.
    """

    @property
    def message(self) -> Message: ...

    async def settle(self, settlement: Settlement) -> bool:
        """Carry out the settlement; True once the broker has it (a dead letter confirmed)."""
        ...


def withdrawn(delivery: Delivery) -> bool:
    """Whether the transport took the delivery back (its optional `withdrawn` attribute): its
    claim is given back rather than run."""
    return bool(getattr(delivery, "withdrawn", False))


Process = Callable[[str, Sequence[Delivery]], Coroutine[Any, Any, None]]


class Publisher(Protocol):
    """Publishes to a channel and returns only once the broker has confirmed it durably
    (RabbitMQ publisher confirms, Kafka acks=all). Used by the webhook receiver."""

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None: ...

    async def close(self) -> None: ...


class Transport(abc.ABC):
    """A broker adapter: consume channels, hand deliveries to `process`, settle as told."""

    @abc.abstractmethod
    async def serve(self, channels: Sequence[str], process: Process, stop: asyncio.Event) -> None:
        """Consume until `stop` is set, then stop taking new deliveries and return."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; safe to call twice."""


__all__ = [
    "ACK",
    "BODY_DROPPED_HEADER",
    "DEAD_LETTER_HEADERS",
    "DEFERRALS_HEADER",
    "DELAY_BUCKETS",
    "DETAIL_HEADER",
    "KEY_HEADER",
    "REASON_HEADER",
    "SCOPE_HEADER",
    "Action",
    "Delivery",
    "Process",
    "Publisher",
    "Settlement",
    "Transport",
    "dead_letter_headers",
    "delay_bucket",
    "dlq_name",
    "withdrawn",
]
