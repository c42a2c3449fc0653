"""Counts the claims table cannot hold by itself, for the status page: duplicates suppressed
and conflicts per scope. Buffered in memory and written every few seconds in one statement,
never per message. A conflict's record and event are not counts: they are written before its
message is settled (dedupe.claims.conflict_records)."""

from __future__ import annotations

import collections

from dedupe.claims.store import ClaimStore
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.pipeline.observers import FlushingObserver, outcome_of
from dedupe.sql import queries
from dedupe.transport import Settlement


class Activity(FlushingObserver):
    """An observer (workers) and a counter (receivers) flushed to PostgreSQL periodically."""

    task_name = "dedupe-activity"

    def __init__(self, store: ClaimStore, *, interval_s: float = 5.0) -> None:
        self.store = store
        self.interval_s = interval_s
        self._duplicates: collections.Counter[str] = collections.Counter()
        self._conflicts: collections.Counter[str] = collections.Counter()
        self._q = queries("operations.sql")

    def concluded(
        self,
        handler: str,
        scope: str,
        key: str,
        message: Message,
        settlement: Settlement,
        started: float,
    ) -> None:
        outcome = outcome_of(settlement)
        if outcome == "duplicate":
            self._duplicates[scope] += 1
        elif outcome == "conflict":
            self._conflicts[scope] += 1

    def duplicate(self, scope: str) -> None:
        self._duplicates[scope] += 1

    def conflict(self, scope: str) -> None:
        self._conflicts[scope] += 1

    async def flush(self) -> None:
        """Write what was counted since the last flush (kept for the next one on failure)."""
        duplicates, conflicts = self._duplicates, self._conflicts
        if not (duplicates or conflicts):
            return
        self._duplicates, self._conflicts = collections.Counter(), collections.Counter()
        scopes = sorted(set(duplicates) | set(conflicts))
        try:
            await self.store.pool.execute(
                self._q["add_counts"],
                scopes,
                [duplicates[s] for s in scopes],
                [conflicts[s] for s in scopes],
            )
        except Exception as exc:
            self._duplicates.update(duplicates)
            self._conflicts.update(conflicts)
            raise StoreError(f"could not record activity: {exc}") from exc
