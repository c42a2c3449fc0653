"""Counts the claims table cannot hold by itself, for the status page: duplicates suppressed
and conflicts per scope, plus a history event and a record (dedupe_conflicts: both
fingerprints, the diff, the second payload when kept) per conflict. Buffered in memory and
written every few seconds in one statement each, never per message."""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Mapping
from typing import Any

from dedupe.claims.conflicts import ConflictReport
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import storable_text
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.pipeline.observers import FlushingObserver, outcome_of
from dedupe.sql import queries
from dedupe.transport import Settlement

logger = logging.getLogger(__name__)

# Conflict records buffered between two flushes (each may hold a 64 KiB payload): a flood of
# conflicts is counted and dead-lettered, not all recorded.
MAX_REPORTS = 100
ReportKey = tuple[str, str, bytes]


class Activity(FlushingObserver):
    """An observer (workers) and a counter (receivers) flushed to PostgreSQL periodically."""

    task_name = "dedupe-activity"

    def __init__(self, store: ClaimStore, *, interval_s: float = 5.0) -> None:
        self.store = store
        self.interval_s = interval_s
        self._duplicates: collections.Counter[str] = collections.Counter()
        self._conflicts: collections.Counter[str] = collections.Counter()
        self._events: list[tuple[str, str, str, str]] = []
        self._reports: dict[ReportKey, tuple[ConflictReport, int]] = {}
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
            self.conflict(scope, key, settlement.detail or "", report=settlement.conflict)

    def duplicate(self, scope: str) -> None:
        self._duplicates[scope] += 1

    def conflict(
        self, scope: str, key: str, detail: str, *, report: ConflictReport | None = None
    ) -> None:
        self._conflicts[scope] += 1
        if report is not None:
            detail = report.event_detail()
            ident = (scope, key, report.payload_hash)
            if ident in self._reports:  # the same message again: one record, counted
                kept, count = self._reports[ident]
                self._reports[ident] = (kept, count + 1)
            elif len(self._reports) < MAX_REPORTS:
                self._reports[ident] = (report, 1)
        if len(self._events) < 1000:  # a flood of conflicts is counted, not all recorded
            self._events.append((scope, key, "conflict", detail[:300]))

    async def flush(self) -> None:
        """Write what was counted since the last flush (kept for the next one on failure)."""
        duplicates, conflicts, events = self._duplicates, self._conflicts, self._events
        reports = self._reports
        if not (duplicates or conflicts or events or reports):
            return
        self._duplicates, self._conflicts, self._events, self._reports = (
            collections.Counter(),
            collections.Counter(),
            [],
            {},
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
                if reports:
                    rows = [_record(report, count) for report, count in reports.values()]
                    await conn.execute(
                        self._q["add_conflicts"], *[list(c) for c in zip(*rows, strict=True)]
                    )
        except Exception as exc:
            self._duplicates.update(duplicates)
            self._conflicts.update(conflicts)
            self._events[:0] = events[: 1000 - len(self._events)]
            for ident, (report, count) in reports.items():
                if ident in self._reports:
                    count += self._reports[ident][1]
                if ident in self._reports or len(self._reports) < MAX_REPORTS:
                    self._reports[ident] = (report, count)
            raise StoreError(f"could not record activity: {exc}") from exc


def _record(report: ConflictReport, deliveries: int) -> tuple[Any, ...]:
    """A conflict's row for add_conflicts, every text made storable (a header or a path may
    hold a NUL, which jsonb refuses: one message must not fail the flush of all)."""
    return (
        report.scope,
        report.key,
        report.payload_hash,
        storable_text(report.fingerprint, 600),
        storable_text(report.claimed, 600),
        None if report.changes is None else json.dumps(list(report.changes)),
        report.more,
        None if report.note is None else storable_text(report.note, 500),
        report.channel,
        None if report.message_id is None else storable_text(report.message_id, 1000),
        json.dumps(_storable_headers(report.headers)),
        None if report.content_type is None else storable_text(report.content_type, 255),
        report.payload,
        report.source,
        deliveries,
    )


def _storable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {
        storable_text(name, 200): storable_text(value, 4000)
        for name, value in list(headers.items())[:200]
    }
