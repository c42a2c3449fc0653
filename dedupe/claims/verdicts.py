"""The claim protocol's verdicts: a key derived once, claimed in shared statements, and what
each answer means (ours, a duplicate, in flight elsewhere, a conflict, a failure to resend).

The worker's pipeline, the webhook receiver and the HTTP middleware all claim through here and
only map the verdicts to what their edge answers (a run, an HTTP status).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dedupe.claims.batching import Batcher
from dedupe.claims.conflicts import RUN_AS_HEADER, RUN_AS_SCOPE_HEADER
from dedupe.claims.fingerprints import RAW, Fingerprint, claim_request
from dedupe.claims.keys import KeyFunc, derive_key
from dedupe.claims.records import Claim, ClaimRequest, Fence, KeyId, Reason
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import check_claimable
from dedupe.errors import InvalidKey, InvalidPayload, KeyMissing, StoreError
from dedupe.message import Message

logger = logging.getLogger("dedupe.claims")

# How many times a key whose row the claim statement could not see (committed concurrently,
# or deleted by clean-up or an operator) is claimed again at once before it counts as in flight.
RECLAIM_TRIES = 3
RECLAIM_PAUSE_S = 0.01


@dataclass(frozen=True, slots=True)
class Terms:
    """How long a claim holds its key, and how long its outcome is remembered."""

    lease_s: float
    retention_s: float


# -- verdicts --------------------------------------------------------------------------------


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class Ours:
    """The key is ours to run: new, taken over from a lapsed lease, or a released failure."""

    fence: Fence
    attempts: int  # the count the claims table holds for the key
    taken_over: bool  # from a worker whose lease lapsed: a crash is in its history
    handed_back: bool  # from a worker that gave it back at a graceful stop

    @property
    def counted(self) -> bool:
        """Whether the claim counted this run's attempt (a new or released key); a taken-over
        or handed-back key's attempt is counted just before its run starts."""
        return not (self.taken_over or self.handed_back)


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class Duplicate:
    """The key has its outcome: completed (with its stored result), or failed for good."""

    status: str
    result: str | None
    # A failed key's recorded reason and detail (its requests' fault replies).
    reason: Reason | None = None
    error: str | None = None


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class InFlight:
    """Another holder's live lease (or a row not visible after RECLAIM_TRIES): come back later."""


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class Conflict:
    """The key was first claimed with another payload: never run this one."""

    status: str
    fingerprint: str | None = None  # the claim's scheme (None: raw)
    payload_hash: bytes | None = None  # the claim's hash under it
    payload: bytes | None = field(default=None, repr=False)  # the claim's kept payload


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class Unsent:
    """Failed for good, but its dead letter was never confirmed (its worker died in between):
    send it again, at least once."""

    reason: Reason
    detail: str
    fence: Fence  # the failure's token: the dead letter's confirmation is recorded against it


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class Unclaimable:
    """No claim could be made for this message: no key, a key the table cannot hold, a body
    the key cannot be read from."""

    reason: Reason
    detail: str


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see dedupe/claims/records.py
class Unavailable:
    """The claim statement failed (the database is unreachable): try the message again."""

    error: str


Verdict = Ours | Duplicate | InFlight | Conflict | Unsent | Unclaimable | Unavailable


def _reason_of(recorded: str | None) -> Reason:
    """The reason a failed claim recorded in its own column; handler_error for a failure
    recorded without one (written by hand, or by a worker older than migration 0010 after it
    ran) or with one this version does not know."""
    if recorded is None or recorded not in Reason.__members__.values():
        return Reason.HANDLER_ERROR
    return Reason(recorded)


def verdict_of(claim: Claim) -> Verdict | None:
    """What a claim's answer means; None when the row was not visible (claim it again)."""
    if claim.token is not None:
        return Ours(
            Fence(claim.scope, claim.key, claim.token),
            attempts=claim.attempts,
            taken_over=claim.taken_over,
            handed_back=claim.handed_back,
        )
    if claim.refused is not None:
        return Unclaimable(Reason.INVALID_KEY, claim.refused)
    if claim.status is None:
        return None
    if claim.same_payload is False:
        return Conflict(claim.status, claim.row_fingerprint, claim.row_hash, claim.row_payload)
    if claim.status == "failed" and not claim.dead_lettered and claim.row_token is not None:
        return Unsent(
            _reason_of(claim.reason),
            claim.error or "",
            Fence(claim.scope, claim.key, claim.row_token),
        )
    if claim.status == "completed":
        return Duplicate(claim.status, claim.result)
    if claim.status == "failed":
        return Duplicate(claim.status, None, _reason_of(claim.reason), claim.error or "")
    return InFlight()


# -- a message's key, derived once -----------------------------------------------------------


def request_for(
    message: Message,
    *,
    key_func: KeyFunc,
    scope_of: Callable[[Message], str | None],
    fingerprint: Fingerprint = RAW,
    keep_payload: bool = False,
) -> ClaimRequest | Unclaimable:
    """The claim a message asks for under a handler (its scope, key and payload's
    fingerprint), or why it has none."""
    try:
        scope = scope_of(message)
        if not scope:
            raise KeyMissing("the message has no tenant where the handler's scope looks")
        key = _run_as(message, scope) or derive_key(key_func, message)
        check_claimable(scope, key)
        return claim_request(scope, key, message, fingerprint, keep_payload=keep_payload)
    except InvalidKey as exc:
        return Unclaimable(Reason.INVALID_KEY, str(exc))
    except KeyMissing as exc:
        return Unclaimable(Reason.MISSING_KEY, str(exc))
    except InvalidPayload as exc:
        return Unclaimable(Reason.INVALID_PAYLOAD, str(exc))


def _run_as(message: Message, scope: str) -> str | None:
    """The key an operator gave this message's scope when settling a conflict, if any."""
    headers = message.headers
    if RUN_AS_SCOPE_HEADER in headers and headers[RUN_AS_SCOPE_HEADER] == scope:
        return headers.get(RUN_AS_HEADER) or None
    return None


# -- claiming --------------------------------------------------------------------------------


class Claims:
    """Claims keys in statements shared by concurrent callers, and reads their verdicts.

    Per name (a handler, a webhook source), whatever arrives while a claim statement is in
    flight goes out together in the next one (dedupe.claims.batching); a key present twice in
    one flush goes in a later statement, where it meets the first one's claim.

    A caller that stops waiting (its timeout struck while the statement waited on a lock) does
    not stop the shared statement: the keys it claimed for that caller are given back as soon
    as it returns, and a claim of one of those keys waits for that first, so a prompt retry is
    not told "in flight" by a claim nobody holds.
    """

    def __init__(self, store: ClaimStore) -> None:
        self.store = store
        self._batchers: dict[tuple[str, Terms], Batcher[ClaimRequest, Claim]] = {}
        # Keys being given back (see above): one event per caller that left with the key.
        self._leaving: dict[KeyId, list[asyncio.Event]] = {}
        self._undoing: set[asyncio.Task[None]] = set()

    async def claim(
        self, name: str, terms: Terms, requests: Sequence[ClaimRequest]
    ) -> list[Verdict]:
        """The verdict of each request (distinct keys), claimed in shared statements."""
        if not requests:
            return []
        batcher = self._batchers.get((name, terms))
        if batcher is None:

            async def flush(batch: Sequence[ClaimRequest]) -> list[Claim]:
                return await self._claim_distinct(terms, batch)

            batcher = self._batchers[(name, terms)] = Batcher(flush)
        if self._leaving:
            for request in requests:
                for leaving in list(self._leaving.get(request.ident, ())):
                    await leaving.wait()
        submitted = batcher.submit(requests)
        try:
            claims = await asyncio.shield(submitted)
        except asyncio.CancelledError:
            if not batcher.withdraw(submitted):  # a statement carries it: undo what it does
                self._give_back_when_claimed(requests, submitted)
            raise
        except StoreError as exc:
            return [Unavailable(str(exc))] * len(requests)
        verdicts: list[Verdict] = []
        for request, claim in zip(requests, claims, strict=True):
            verdict = verdict_of(claim)
            verdicts.append(
                verdict if verdict is not None else await self.claim_one(terms, request)
            )
        return verdicts

    def _give_back_when_claimed(
        self, requests: Sequence[ClaimRequest], submitted: asyncio.Future[list[Claim]]
    ) -> None:
        gates = []
        for request in requests:
            gate = asyncio.Event()
            self._leaving.setdefault(request.ident, []).append(gate)
            gates.append(gate)
        task = asyncio.create_task(
            self._give_back(requests, submitted, gates), name="dedupe-give-back"
        )
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)

    async def _give_back(
        self,
        requests: Sequence[ClaimRequest],
        submitted: asyncio.Future[list[Claim]],
        gates: Sequence[asyncio.Event],
    ) -> None:
        """Give back each key a statement claimed for a caller that left (its run never
        started: an attempt the claim counted is taken back, as Leases.give_back does), and
        let that key's next claims go."""
        try:
            try:
                claims = await submitted
            except Exception:  # the statement failed: nothing to give back
                return
            for request, claim, gate in zip(requests, claims, gates, strict=True):
                verdict = verdict_of(claim)
                if isinstance(verdict, Ours):
                    logger.info("key %s: claimed for a caller that left; given back", request.key)
                    with contextlib.suppress(StoreError):
                        await self.store.give_back(
                            verdict.fence,
                            attempt=verdict.attempts if verdict.counted else None,
                            handed_back=not verdict.taken_over,
                        )
                self._open(request.ident, gate)
        finally:
            for request, gate in zip(requests, gates, strict=True):
                self._open(request.ident, gate)

    def _open(self, ident: KeyId, gate: asyncio.Event) -> None:
        if gate.is_set():
            return
        gate.set()
        gates = self._leaving.get(ident)
        if gates is not None:
            with contextlib.suppress(ValueError):
                gates.remove(gate)
            if not gates:
                del self._leaving[ident]

    async def claim_one(self, terms: Terms, request: ClaimRequest) -> Verdict:
        """Claim one key in a statement of its own, claiming again while its row is not visible."""
        for _ in range(RECLAIM_TRIES):
            try:
                [claim] = await self.store.claim_batch(
                    [request], lease_s=terms.lease_s, retention_s=terms.retention_s
                )
            except StoreError as exc:
                return Unavailable(str(exc))
            verdict = verdict_of(claim)
            if verdict is not None:
                return verdict
            # The row vanished (released, cleaned up) or was committed by a concurrent claim
            # after our statement's snapshot: ask again.
            await asyncio.sleep(RECLAIM_PAUSE_S)
        return InFlight()

    async def _claim_distinct(self, terms: Terms, requests: Sequence[ClaimRequest]) -> list[Claim]:
        claims: list[Claim | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        while todo:
            seen: set[KeyId] = set()
            now: list[int] = []
            later: list[int] = []
            for i in todo:
                ident = requests[i].ident
                (later if ident in seen else now).append(i)
                seen.add(ident)
            got = await self.store.claim_batch(
                [requests[i] for i in now], lease_s=terms.lease_s, retention_s=terms.retention_s
            )
            for i, claim in zip(now, got, strict=True):
                claims[i] = claim
            todo = later
        return [claim for claim in claims if claim is not None]


__all__ = [
    "RECLAIM_TRIES",
    "Claims",
    "Conflict",
    "Duplicate",
    "InFlight",
    "Ours",
    "Terms",
    "Unavailable",
    "Unclaimable",
    "Unsent",
    "Verdict",
    "request_for",
    "verdict_of",
]
