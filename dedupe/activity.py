"""Counts the claims table cannot hold by itself, for the status page: duplicates suppressed
and conflicts per scope, plus a history event per conflict. Buffered in memory and written
every few seconds in one statement each, never per message."""

from __future__ import annotations

import collections
import logging
from typing import Any

from .errors import StoreError
from .message import Message
from .observe import FlushingObserver, outcome_of
from .sql import queries
from .store import ClaimStore
from .transport import Settlement

logger = logging.getLogger(__name__)


class Activity(FlushingObserver):
    """An observer (workers) and a counter (receivers) flushed to PostgreSQL periodically."""

    task_name = "dedupe-activity"

    def __init__(self, store: ClaimStore, *, interval_s: float = 5.0) -> None:
        self.store = store
        self.interval_s = interval_s
        self._duplicates: collections.Counter[str] = collections.Counter()
        self._conflicts: collections.Counter[str] = collections.Counter()
        self._events: list[tuple[str, str, str, str]] = []
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
            self.conflict(scope, key, settlement.detail or "")

    def duplicate(self, scope: str) -> None:
        self._duplicates[scope] += 1

    def conflict(self, scope: str, key: str, detail: str) -> None:
        self._conflicts[scope] += 1
        if len(self._events) < 1000:  # a flood of conflicts is counted, not all recorded
            self._events.append((scope, key, "conflict", detail[:300]))

    async def flush(self) -> None:
        """Write what was counted since the last flush (kept for the next one on failure)."""
        duplicates, conflicts, events = self._duplicates, self._conflicts, self._events
        if not (duplicates or conflicts or events):
            return
        self._duplicates, self._conflicts, self._events = (
            collections.Counter(),
            collections.Counter(),
            [],
        )
        scopes = sorted(set(duplicates) | set(conflicts))
        try:
            async with self.store.pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    self._q["add_counts"],
                    scopes,
                    [duplicates[s] for s in scopes],
                    [conflicts[s] for s in scopes],
                )
                if events:
                    columns: list[list[Any]] = [list(c) for c in zip(*events, strict=True)]
                    await conn.execute(self._q["add_events"], *columns)
        except Exception as exc:
            self._duplicates.update(duplicates)
            self._conflicts.update(conflicts)
            self._events[:0] = events[: 1000 - len(self._events)]
            raise StoreError(f"could not record activity: {exc}") from exc
