"""The claim protocol: what a claim is made of (key, scope, fingerprint, storable values), its
records and verdicts, the claim store on PostgreSQL, the leases held while a run waits, and the
fenced completion. It knows nothing of brokers, handlers or HTTP."""

from __future__ import annotations

from dedupe.claims.completion import (
    Completion,
    HandlerTransaction,
    OutboxRow,
    add_to_outbox,
    complete_in,
    complete_in_transaction,
)
from dedupe.claims.records import Claim, ClaimRequest, Fence, KeyId, Reason
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import (
    Claims,
    Conflict,
    Duplicate,
    InFlight,
    Ours,
    Unavailable,
    Unclaimable,
)

__all__ = [
    "Claim",
    "ClaimRequest",
    "ClaimStore",
    "Claims",
    "Completion",
    "Conflict",
    "Duplicate",
    "Fence",
    "HandlerTransaction",
    "InFlight",
    "KeyId",
    "Ours",
    "OutboxRow",
    "Reason",
    "Unavailable",
    "Unclaimable",
    "add_to_outbox",
    "complete_in",
    "complete_in_transaction",
]
