"""Key-level operations for operators: history, stuck keys, recent trouble, purge, overview,
and the outbox's backlog."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from . import outbox
from .errors import StoreError
from .sql import queries
from .store import TRANSIENT_ERRORS, ClaimStore

FINISHED = ("completed", "failed")
TROUBLE = ("failed", "dead_lettered", "conflict", "taken_over", "released")


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
        """The claim with its trace id and its history of rare events (oldest first)."""
        rows = await self._fetch("show_claim", scope, key)
        if not rows:
            return None
        claim = rows[0]
        claim["history"] = await self._fetch("history", scope, key)
        return claim

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
