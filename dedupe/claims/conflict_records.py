"""Conflict records written before their message is settled: a worker's dead letter, the
receiver's or the HTTP middleware's 422 waits for the record's commit, so a crash right after
the answer loses no record (and for a webhook, no second payload: nothing else holds it).

A conflict is rare: it takes one statement of its own, never a round trip of the messages
that do not conflict. A flood of one payload is one row counting its deliveries (a row per
(scope, key, payload hash)), never records dropped by a buffer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import asyncpg

from dedupe.claims.conflicts import ConflictReport
from dedupe.claims.database import TRANSIENT_ERRORS
from dedupe.claims.values import storable_text
from dedupe.errors import StoreError
from dedupe.sql import queries

ReportKey = tuple[str, str, bytes]


async def record(
    pool: asyncpg.Pool | asyncpg.Connection, reports: Iterable[ConflictReport]
) -> None:
    """Record the conflicts (one statement; a payload seen again counts a delivery), with the
    history's `conflict` event of each new record. StoreError when it could not commit: do not
    settle the message then (a redelivery records it)."""
    counted: dict[ReportKey, tuple[ConflictReport, int]] = {}
    for report in reports:
        ident = (report.scope, report.key, report.payload_hash)
        kept, count = counted.get(ident, (report, 0))
        counted[ident] = (kept, count + 1)
    if not counted:
        return
    rows = [_row(report, deliveries) for report, deliveries in counted.values()]
    columns = [list(column) for column in zip(*rows, strict=True)]
    try:
        await pool.execute(queries("operations.sql")["record_conflicts"], *columns)
    except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
        raise StoreError(
            f"could not record a key conflict: {exc.__class__.__name__}: {exc}"
        ) from exc


def _row(report: ConflictReport, deliveries: int) -> tuple[Any, ...]:
    """A conflict's row for record_conflicts, every text made storable (a header or a path may
    hold a NUL, which jsonb refuses: one message must not fail the statement of all)."""
    return (
        report.scope,
        report.key,
        report.payload_hash,
        storable_text(report.fingerprint, 600),
        storable_text(report.claimed, 600),
        None if report.changes is None else json.dumps(list(report.changes)),
        report.more,
        None if report.note is None else storable_text(report.note, 500),
        None if report.http_request is not None else report.channel,
        None if report.message_id is None else storable_text(report.message_id, 1000),
        json.dumps(_storable_headers(report.headers)),
        None if report.content_type is None else storable_text(report.content_type, 255),
        report.payload,
        report.source,
        deliveries,
        None if report.http_request is None else storable_text(report.http_request, 1000),
        report.event_detail(),
    )


def _storable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {
        storable_text(name, 200): storable_text(value, 4000)
        for name, value in list(headers.items())[:200]
    }


__all__ = ["record"]
