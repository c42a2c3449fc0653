"""The worker's counters: what the pipeline decided, for logs, the demo summary and metrics."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any


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
    outbox_gc_deleted: int = 0  # sent outbox rows past their retention removed by it
    # Group commit: COMMITs of a lane's group, and the members they completed (members / groups
    # is the mean group size: the figure that says whether grouping pays).
    groups_committed: int = 0
    group_members_committed: int = 0
    # One-transaction mode: first deliveries claimed, run and completed in one transaction,
    # and the messages of one_transaction=True handlers that took the two-commit path, by why.
    one_transaction: int = 0
    one_transaction_fallbacks: collections.Counter[str] = field(default_factory=collections.Counter)
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
            "outbox_gc_deleted": self.outbox_gc_deleted,
            "groups_committed": self.groups_committed,
            "group_members_committed": self.group_members_committed,
            "one_transaction": self.one_transaction,
            "one_transaction_fallbacks": dict(self.one_transaction_fallbacks),
            "dead_lettered": dict(self.dead_lettered),
        }


__all__ = ["Stats"]
