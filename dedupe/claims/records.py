"""What the claim protocol's statements take and answer: a claim request, its answer (ours, or
the row in the way), and the fence a claim of ours is held by. No I/O.

These records, the verdicts (dedupe.claims.verdicts) and the ticket are made once or more per
message inside the pipeline, and treated as values: nothing assigns to them after they are made.
They are not `frozen=True` only because a frozen dataclass's `__init__` sets each field through
`object.__setattr__`: 6.2 us for a `Claim` against 1.2 us. `unsafe_hash=True` keeps the hash a
frozen one would have (eq and hash over the fields), so they still work as keys. What users and
transports are handed stays frozen: `dedupe.Message` and `Settlement` (shared constants such as
`ACK` among them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class Reason(enum.StrEnum):
    """Why a message went to the dead-letter queue (the `x-dedupe-reason` header)."""

    KEY_CONFLICT = "key_conflict"
    MISSING_KEY = "missing_key"
    INVALID_KEY = "invalid_key"  # a key or scope the claims table cannot store (NUL, too long)
    INVALID_PAYLOAD = "invalid_payload"
    MAX_ATTEMPTS = "max_attempts_exceeded"
    REJECTED = "rejected"
    HANDLER_ERROR = "handler_error"
    NO_HANDLER = "no_handler"


class KeyId(NamedTuple):
    """A key's identity: the scope it is claimed in and the key (the claims table's primary
    key). Equal to the plain tuple `(scope, key)`."""

    scope: str
    key: str


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see above
class ClaimRequest:
    """The claim a message asks for: its key and its payload's fingerprint
    (dedupe.claims.fingerprints)."""

    scope: str
    key: str
    payload_hash: bytes  # SHA-256 of the payload under `fingerprint`
    fingerprint: str | None = None  # the scheme, stored with the claim; None: the raw bytes
    # SHA-256 of the body bytes, under any other scheme: a claim stored under the raw scheme
    # (before the handler's fingerprint changed) is compared with it.
    raw_hash: bytes | None = None
    # The body, kept with a new claim (keep_payload), so a conflict can show what differs.
    payload: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def ident(self) -> KeyId:
        return KeyId(self.scope, self.key)

    def row(
        self, owner: str
    ) -> tuple[str, str, bytes, str | None, bytes | None, bytes | None, str]:
        """The first seven parameters ($1..$7) of every one-key insert of a claim row (the
        workers' and the HTTP middleware's one-transaction claims, first_attempt_failed)."""
        return (
            self.scope,
            self.key,
            self.payload_hash,
            self.fingerprint,
            self.raw_hash,
            self.payload,
            owner,
        )


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see above
class Claim:
    """The answer to one claim: ours (a token) or the state of the row in the way."""

    scope: str
    key: str
    token: int | None
    attempts: int
    taken_over: bool = False  # re-claimed from a worker whose lease lapsed (it died)
    handed_back: bool = False  # re-claimed after a worker handed it back at a graceful stop
    status: str | None = None
    same_payload: bool | None = None
    lease_live: bool | None = None
    result: str | None = None
    reason: str | None = None  # a failed row's Reason value (None: recorded without one)
    error: str | None = None  # a failed row's detail
    dead_lettered: bool | None = None
    row_token: int | None = None  # the token of the row in the way (not ours)
    # A conflict's other side: the claim's scheme (None: raw), its hash and its kept payload.
    row_fingerprint: str | None = None
    row_hash: bytes | None = None
    row_payload: bytes | None = field(default=None, repr=False)
    refused: str | None = None  # PostgreSQL refused this claim's values: why

    @property
    def owned(self) -> bool:
        return self.token is not None

    @property
    def ident(self) -> KeyId:
        return KeyId(self.scope, self.key)


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see above
class Fence:
    """A claim we hold: the token proves it at heartbeat and completion. (The HTTP
    middleware's one-transaction run holds dedupe.claims.completion.SESSION_TOKEN, 0, no
    sequence's token: "the one this session drew", which only its completion reads.)"""

    scope: str
    key: str
    token: int

    @property
    def ident(self) -> KeyId:
        return KeyId(self.scope, self.key)


__all__ = ["Claim", "ClaimRequest", "Fence", "KeyId", "Reason"]
