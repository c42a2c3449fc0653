"""The dead-letter replay policy of every broker: what is skipped, released first, and stripped.

A broker's admin client reads its dead letters and publishes them back; what that means is
decided here, once, with no I/O of its own:

- a dead letter written without its body cannot run again: it is skipped (and says why);
- one whose own claim failed (the handler gave up, rejected it or could not decode it)
  releases that claim *before* its copy is republished, so that a worker seeing the copy finds
  the claim claimable; a key_conflict dead letter names the OTHER payload's claim (which may
  be running) and missing_key / no_handler / invalid_key name none: those release nothing;
- the copy goes back without the headers we added (the dead-letter vocabulary and the
  broker's own, such as RabbitMQ's deferral count), with the sender's headers intact.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dedupe.claims.conflicts import CLAIMED_FINGERPRINT_HEADER, DIFF_HEADER, FINGERPRINT_HEADER
from dedupe.claims.records import KeyId, Reason
from dedupe.message import Headers
from dedupe.transport import (
    BODY_DROPPED_HEADER,
    DEAD_LETTER_HEADERS,
    DETAIL_HEADER,
    KEY_HEADER,
    REASON_HEADER,
    SCOPE_HEADER,
)

T = TypeVar("T")
# release(scope, key): make a failed claim claimable again (ClaimStore.release_failed).
Release = Callable[[str, str], Awaitable[object]]

# Reasons whose dead letter names a claim of its own that failed.
FAILED_CLAIM_REASONS = frozenset(
    reason.value
    for reason in (
        Reason.MAX_ATTEMPTS,
        Reason.HANDLER_ERROR,
        Reason.REJECTED,
        Reason.INVALID_PAYLOAD,
    )
)


def claim_to_release(headers: Mapping[str, str]) -> KeyId | None:
    """The (scope, key) of the failed claim a replayed dead letter may release, if any."""
    scope, key = headers.get(SCOPE_HEADER), headers.get(KEY_HEADER)
    if not scope or not key or headers.get(REASON_HEADER) not in FAILED_CLAIM_REASONS:
        return None
    return KeyId(scope, key)


def describe(headers: Mapping[str, Any], *, message_id: str | None) -> dict[str, Any]:
    """A dead letter as `dlq list` shows it: message id, reason, detail, scope and key (and a
    conflict's fingerprints and diff)."""
    info = headers if isinstance(headers, Headers) else Headers(headers)
    row: dict[str, Any] = {
        "message_id": message_id,
        "reason": info.get(REASON_HEADER, "?"),
        "detail": info.get(DETAIL_HEADER, ""),
        "scope": info.get(SCOPE_HEADER),
        "key": info.get(KEY_HEADER),
    }
    if DIFF_HEADER in info:  # a key_conflict's: both fingerprints and what differs
        row["fingerprint"] = info.get(FINGERPRINT_HEADER)
        row["claimed_fingerprint"] = info.get(CLAIMED_FINGERPRINT_HEADER)
        row["diff"] = info[DIFF_HEADER]
    return row


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """What replaying one dead letter takes: the claim to release, then the copy to send."""

    row: dict[str, Any]  # message_id, reason, scope, key: what `dlq replay` reports
    headers: dict[str, Any] = field(default_factory=dict)  # the copy's: the sender's alone
    release: KeyId | None = None  # the failed claim released before the copy
    skipped: str | None = None  # why it cannot run again (then nothing is done)

    async def carry_out(
        self,
        *,
        release: Release | None,
        republish: Callable[[dict[str, Any]], Awaitable[T]],
    ) -> T | None:
        """Release the failed claim (if any), then republish the copy: never the other way
        round. A skipped dead letter does neither and gives None."""
        if self.skipped is not None:
            return None
        if release is not None and self.release is not None:
            await release(*self.release)
        return await republish(dict(self.headers))  # the caller may take from its copy


class ReplayPolicy:
    """Plans the replay of dead letters; `own_headers` are the broker's additions to strip."""

    def __init__(self, *, own_headers: Iterable[str] = ()) -> None:
        self.own_headers = frozenset((*DEAD_LETTER_HEADERS, BODY_DROPPED_HEADER, *own_headers))

    def plan(self, headers: Mapping[str, Any], *, message_id: str | None) -> ReplayStep:
        """The step for one dead letter with these headers (as the broker stores them)."""
        info = Headers(headers)
        described = describe(info, message_id=message_id)
        row = {name: described[name] for name in ("message_id", "reason", "scope", "key")}
        dropped = info.get(BODY_DROPPED_HEADER)
        if dropped is not None:
            return ReplayStep(row, skipped=f"it was dead-lettered without its body ({dropped})")
        kept = {name: value for name, value in headers.items() if name not in self.own_headers}
        return ReplayStep(row, kept, claim_to_release(info))


__all__ = [
    "FAILED_CLAIM_REASONS",
    "Release",
    "ReplayPolicy",
    "ReplayStep",
    "claim_to_release",
    "describe",
]
