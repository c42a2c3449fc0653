"""Key-level operations for operators: history, stuck keys, recent trouble, purge, overview,
the outbox's backlog, and settling a conflict (discard its second payload, or run it under a
new key)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from dedupe.claims.completion import add_to_outbox
from dedupe.claims.conflicts import RUN_AS_HEADER, RUN_AS_SCOPE_HEADER
from dedupe.claims.database import TRANSIENT_ERRORS
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import check_claimable
from dedupe.effects import outbox
from dedupe.errors import DedupeError, InvalidKey, StoreError
from dedupe.sql import queries
from dedupe.webhooks.sources import MAX_MESSAGE_ID_BYTES, WEBHOOK_KEY_HEADER

FINISHED = ("completed", "failed")
TROUBLE = ("failed", "dead_lettered", "conflict", "taken_over", "released")
# How long a run-as copy's outbox row is kept once sent (it is relayed within seconds).
SETTLED_COPY_RETENTION_S = 86_400.0


class NotSettled(DedupeError):
    """The conflict could not be settled as asked; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Settled:
    """A settled conflict: how, and where a run-as copy goes."""

    conflict_id: int
    how: str  # "discarded" or "run as <key>"
    fingerprint: str  # the second payload's
    channel: str | None  # None: an HTTP request's (see http_request)
    message_id: str | None  # the run-as copy's
    source: str | None = None  # the webhook source that answered 422
    http_request: str | None = None  # the HTTP middleware's 422: 'POST /orders'


class ClaimAdmin:
    """What `dedupe-worker claims`, `status` and the status page ask of the claims table."""

    def __init__(self, store: ClaimStore) -> None:
        self.store = store
        self._q = queries("operations.sql")

    async def _fetch(self, name: str, *args: Any) -> list[dict[str, Any]]:
        try:
            return [dict(row) for row in await self.store.pool.fetch(self._q[name], *args)]
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
            raise StoreError(f"{name} failed: {exc.__class__.__name__}: {exc}") from exc

    async def show(self, scope: str, key: str) -> dict[str, Any] | None:
        """The claim with its trace id, its history of rare events and its conflicts (both
        fingerprints, the paths that differ), oldest first."""
        rows = await self._fetch("show_claim", scope, key)
        if not rows:
            return None
        claim = rows[0]
        claim["history"] = await self._fetch("history", scope, key)
        claim["conflicts"] = _decoded(await self._fetch("conflicts_of", scope, key))
        return claim

    async def conflicts(
        self, *, scope: str | None = None, settled: bool = False, limit: int = 50
    ) -> list[dict[str, Any]]:
        """Recorded conflicts, newest first: the unsettled ones, or all with `settled`."""
        return _decoded(await self._fetch("list_conflicts", scope, limit, settled))

    async def release(self, scope: str, key: str) -> str | None:
        """Let a stuck or failed key run again; its status before, None if not releasable."""
        return await self.store.release(scope, key)

    async def stuck(self, *, older_than_s: float = 60.0, limit: int = 50) -> list[dict[str, Any]]:
        """In-progress claims older than `older_than_s`, oldest first."""
        return await self._fetch("stuck", float(older_than_s), limit)

    async def recent(
        self, events: Sequence[str] = TROUBLE, *, limit: int = 20
    ) -> list[dict[str, Any]]:
        """The latest events of these kinds (failed, dead_lettered, conflict ...), newest first."""
        return await self._fetch("recent_events", list(events), limit)

    async def overview(self) -> list[dict[str, Any]]:
        """Per handler: claims by status, duplicates suppressed, conflicts seen."""
        return await self._fetch("overview")

    async def outbox(self, *, limit: int = 20) -> dict[str, Any]:
        """The outbox's unsent rows, the oldest one's age (the relay's lag) and the ones the
        broker refused, in all and per channel (`channels`, the most lagging first)."""
        backlog = await outbox.backlog(self.store.pool)
        backlog["channels"] = (
            await outbox.backlog_by_channel(self.store.pool, limit=limit)
            if backlog["unsent"]
            else []
        )
        return backlog

    async def settle_conflict(
        self, scope: str, key: str, *, run_as: str | None, conflict_id: int | None = None
    ) -> Settled:
        """Settle an unsettled conflict of (scope, key): discard its second payload
        (`run_as=None`), or publish it again under the key `run_as` for this scope alone.

        The copy goes through the transactional outbox, committed with the settling, so this
        needs no broker: any running worker relays it (both brokers alike). NotSettled when
        there is no such conflict, several (name one), its payload was not kept, or the new
        key cannot be used.
        """
        if run_as is not None:
            _check_new_key(scope, key, run_as)
        try:
            async with self.store.pool.acquire() as conn, conn.transaction():
                rows = await conn.fetch(self._q["conflicts_to_settle"], scope, key, conflict_id)
                row = _the_one(rows, scope, key, conflict_id)
                if run_as is None:
                    how = "discarded"
                    detail = f"discarded the second payload ({row['fingerprint']})"
                    message_id = None
                elif row["http_request"] is not None:
                    raise NotSettled(
                        f"the conflict of {scope}/{key} is an HTTP request's "
                        f"({row['http_request']}), answered 422: it cannot run from here (its "
                        "body is not kept); its client sends it again under a new "
                        "Idempotency-Key. Settle it with --discard"
                    )
                else:
                    if await conn.fetchval(self._q["claim_status"], scope, run_as) is not None:
                        raise NotSettled(
                            f"{run_as!r} is already claimed in {scope}: choose a key not used "
                            "yet (`claims show` tells)"
                        )
                    if row["payload"] is None:
                        raise NotSettled(
                            f"the second payload of {scope}/{key} was not kept (the handler "
                            "runs without keep_payload=True, or it was over 64 KiB): its copy "
                            f"in {row['channel']}.dlq is the only one; have the producer send it "
                            "again under a new key"
                        )
                    copy = _run_as_copy(row, scope, key, run_as)
                    await add_to_outbox(conn, [copy], retention_s=SETTLED_COPY_RETENTION_S)
                    how, message_id = f"run as {run_as}", copy.message_id
                    detail = f"the second payload ({row['fingerprint']}) runs as key {run_as}"
                await conn.execute(self._q["settle_conflict"], row["id"], how)
                await conn.execute(
                    self._q["add_events"], [scope], [key], ["conflict_settled"], [detail]
                )
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
            raise StoreError(f"settling the conflict failed: {exc}") from exc
        return Settled(
            row["id"],
            how,
            row["fingerprint"],
            row["channel"],
            message_id,
            source=row["source"],
            http_request=row["http_request"],
        )

    async def purge(
        self,
        *,
        older_than_s: float,
        statuses: Sequence[str] = FINISHED,
        scope: str | None = None,
        batch_size: int = 1000,
    ) -> int:
        """Delete finished claims not touched for `older_than_s`; return how many."""
        unknown = set(statuses) - set(FINISHED)
        if unknown:
            raise StoreError(f"cannot purge {sorted(unknown)}: only completed or failed claims")
        deleted = 0
        while True:
            try:
                status = await self.store.pool.execute(
                    self._q["purge_batch"], list(statuses), float(older_than_s), scope, batch_size
                )
            except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
                raise StoreError(f"purge failed: {exc}") from exc
            count = int(status.split()[-1])
            deleted += count
            if count < batch_size:
                return deleted


def _decoded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conflict rows with their diff as a list of changes (None: not known)."""
    for row in rows:
        row["diff"] = None if row["diff"] is None else json.loads(row["diff"])
    return rows


def _check_new_key(scope: str, key: str, run_as: str) -> None:
    if run_as == key:
        raise NotSettled(f"{run_as!r} is already claimed in {scope}: choose a new key")
    try:
        check_claimable(scope, run_as)
    except InvalidKey as exc:
        raise NotSettled(f"the new key cannot be used: {exc}") from exc
    if not run_as.isprintable():
        raise NotSettled("the new key contains control characters: choose another")


def _the_one(
    rows: Sequence[asyncpg.Record], scope: str, key: str, conflict_id: int | None
) -> asyncpg.Record:
    if not rows:
        which = f" with id {conflict_id}" if conflict_id is not None else ""
        raise NotSettled(
            f"no unsettled conflict for {scope}/{key}{which}: `dedupe-worker conflicts list` "
            "shows the recorded ones (--all: settled ones too)"
        )
    if len(rows) > 1:
        ids = ", ".join(str(r["id"]) for r in rows)
        raise NotSettled(
            f"{scope}/{key} has {len(rows)} unsettled conflicts (ids {ids}), one per other "
            "payload: name the one to settle with --id"
        )
    return rows[0]


def _run_as_copy(row: asyncpg.Record, scope: str, key: str, run_as: str) -> outbox.Outgoing:
    """The second payload as the outbox publishes it: the sender's headers, our own removed.

    Behind a handler, the copy keeps its message id (the channel's other handlers see it as the
    duplicate it is for them) and names the new key for the conflicting scope alone. Behind the
    receiver, nothing was published: the copy is the message the receiver would have forwarded
    had the sender used the new key."""
    sent: Mapping[str, str] = json.loads(row["headers"])
    headers = {
        name: value
        for name, value in sent.items()
        if not name.lower().startswith("x-dedupe-") or name.lower().startswith("x-dedupe-webhook-")
    }
    message_id = row["message_id"]
    if row["source"] is not None:
        old = message_id or ""
        prefix = old[: -len(key)] if old.endswith(key) else f"{row['source']}/"
        message_id = prefix + run_as
        if len(message_id.encode()) > MAX_MESSAGE_ID_BYTES:
            raise NotSettled(
                f"with its source and tenant the new key must fit {MAX_MESSAGE_ID_BYTES} bytes "
                "(the forwarded message id): choose a shorter one"
            )
        headers[WEBHOOK_KEY_HEADER] = run_as
    else:
        headers[RUN_AS_SCOPE_HEADER] = scope
        headers[RUN_AS_HEADER] = run_as
        message_id = message_id or run_as
    return outbox.Outgoing(
        producer=f"{scope}\x1f{run_as}",
        channel=row["channel"],
        message_id=message_id,
        body=bytes(row["payload"]),
        headers=headers,
        content_type=row["content_type"],
    )
