"""The transactional outbox: a run's publishes stored with its writes, relayed with confirms.

`ctx.publish` (dedupe.effects.run_effects) collects a run's rows; its fenced completion
(dedupe.claims.completion) stores them in the transaction of its ctx.db writes or, for a run that
wrote nothing else, in one shared with the batch's other such completions
(PublishingCompletions); a zombie's or a rolled-back run's rows never commit.
Every worker's `Relay` takes committed rows, whole producers (a run's scope and key) at a time
and in order, publishes each with the broker's confirm, and marks them sent in the same
transaction that locked them: a relay that dies before it commits leaves them to the next (at
least once; the message id makes a repeat a duplicate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import asyncpg

from dedupe.claims.batching import Batcher
from dedupe.claims.completion import Completion, complete_in
from dedupe.claims.database import TRANSIENT_ERRORS
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import storable_error
from dedupe.errors import BrokerUnavailable, StoreError
from dedupe.sql import queries
from dedupe.transport import Publisher

try:  # the `otel` extra: a row carries the trace context of the run that published it
    from opentelemetry import propagate as _propagate
except ImportError:  # pragma: no cover - depends on the install
    _propagate = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


def with_trace_context(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the W3C trace context (`traceparent`, `tracestate`) of the span current
    now (a run's message span, in ctx.publish), unless they carry one already: the relay sends
    it with the row, so the next stage's span is a child of the publishing run's. Without
    OpenTelemetry, or outside any span, `headers` as they are."""
    if _propagate is None:
        return headers
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    if carrier and not any(name.lower() in carrier for name in headers):
        headers.update(carrier)
    return headers


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message a run publishes, as the outbox stores it."""

    producer: str
    channel: str
    message_id: str
    body: bytes
    headers: dict[str, str]
    content_type: str | None


class PublishingCompletions:
    """Completes runs whose only writes are publishes many at a time: one transaction holds a
    batch's fenced completions and the outbox rows of the runs that completed, so a fenced
    (zombie) run's rows are never stored, and no run pays a commit of its own.

    `on_committed` is called after each commit that stored rows (to wake the relay).
    """

    def __init__(self, store: ClaimStore, *, on_committed: Callable[[], None]) -> None:
        self.store = store
        self._on_committed = on_committed
        self._batcher: Batcher[Completion, bool] = Batcher(self._flush)

    def submit_nowait(self, completion: Completion) -> asyncio.Future[list[bool]]:
        """Queue a run's completion; the future's one-item list says whether it completed
        ([False]: fenced)."""
        return self._batcher.submit_nowait(completion)

    async def _flush(self, items: Sequence[Completion]) -> list[bool]:
        try:
            async with self.store.pool.acquire() as conn, conn.transaction():
                done = await complete_in(self.store, conn, items)
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
            raise StoreError(
                f"completing runs with their publishes failed: {exc.__class__.__name__}: {exc}"
            ) from exc
        completed = [c.fence.ident in done for c in items]
        if any(c.outbox and ok for c, ok in zip(items, completed, strict=True)):
            self._on_committed()
        return completed


@dataclass
class RelayStats:
    """What one relay did: rows sent with the broker's confirm, publishes the broker refused."""

    sent: int = 0
    refused: int = 0


class Relay:
    """Relays committed outbox rows through `publisher`, every `interval_s` and when woken.

    Use as an async context manager; `wake()` after a commit that added rows relays at once.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        publisher: Publisher,
        *,
        interval_s: float = 0.5,
        batch: int = 200,
        concurrency: int = 200,
    ) -> None:
        self.pool = pool
        self.publisher = publisher
        self.interval_s = interval_s
        self.batch = batch
        self.stats = RelayStats()
        # Publishes in flight at once, each producer's one after another: a round of
        # single-row producers (the usual: a run publishes one message) costs a few confirm
        # round trips, not one per row. A round holds an advisory lock per producer it took
        # (up to `batch`): PostgreSQL's lock table (max_locks_per_transaction x
        # max_connections, 6,400 by default) must hold those of every relay at once.
        self._concurrency = concurrency
        self._q = queries("outbox.sql")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.stop_timeout_s = 5.0

    def wake(self) -> None:
        self._wake.set()

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._loop(), name="dedupe-relay")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Finish the round under way and relay what is committed by now, for up to
        `stop_timeout_s`; then cancel (a cancelled round rolls back: its rows are sent again)."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), self.stop_timeout_s)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s * 2**failures):
                    await self._wake.wait()
            self._wake.clear()
            try:
                # A round that moved rows: more may be waiting (another relay may hold the
                # producers this one skipped). One that took rows and sent none waits for the
                # next wake or interval. Stopping, a round that began after the stop still
                # runs: it relays what was committed before the stop.
                while True:
                    stopped_before = self._stopping
                    _, moved = await self._round()
                    if stopped_before or (not moved and not self._stopping):
                        break
                failures = 0
            except BrokerUnavailable as exc:
                # Its rows stay due, uncounted: the relay as a whole waits (at most
                # interval_s * 32, or the next wake) rather than each row a growing backoff
                # that would outlast the broker's return.
                failures = min(failures + 1, 5)
                logger.warning("outbox relay: %s; trying again", exc)
            except StoreError as exc:
                failures = min(failures + 1, 5)
                logger.warning("outbox relay: %s", exc)
            except Exception:  # a bug or a publisher's surprise must not end the relaying
                failures = min(failures + 1, 5)
                logger.exception("outbox relay: unexpected error; trying again")
            if self._stopping:
                return

    async def _round(self) -> tuple[int, int]:
        """One batch: (rows taken, rows sent or refused)."""
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                rows = list(await conn.fetch(self._q["take"], self.batch))
                if not rows:
                    return 0, 0
                sent, refused, unreachable = await self._publish(rows)
                if sent:
                    await conn.execute(self._q["sent"], sent)
                for row_id, error in refused:
                    await conn.execute(self._q["refused"], row_id, error)
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
            raise StoreError(
                f"relaying the outbox failed: {exc.__class__.__name__}: {exc}"
            ) from exc
        self.stats.sent += len(sent)
        self.stats.refused += len(refused)
        if unreachable is not None:  # what was sent is marked; the rest waits for the broker
            raise unreachable
        return len(rows), len(sent) + len(refused)

    async def _publish(
        self, rows: Sequence[asyncpg.Record]
    ) -> tuple[list[int], list[tuple[int, str]], BrokerUnavailable | None]:
        """Each producer's rows in order (one at a time, confirmed); producers side by side.
        A producer stops at its first row not due or refused: its later rows wait for it.
        A broker that cannot be reached refuses no row: they stay due (the error is returned)."""
        sent: list[int] = []
        refused: list[tuple[int, str]] = []
        unreachable: BrokerUnavailable | None = None
        slots = asyncio.Semaphore(self._concurrency)

        async def one_producer(chain: list[asyncpg.Record]) -> None:
            nonlocal unreachable
            async with slots:
                for row in chain:
                    if not row["due"]:
                        return
                    try:
                        headers = json.loads(row["headers"])
                        if row["content_type"]:
                            headers.setdefault("content-type", row["content_type"])
                        await self.publisher.publish(
                            row["channel"],
                            bytes(row["body"]),
                            message_id=row["message_id"],
                            headers=headers,
                        )
                    except BrokerUnavailable as exc:
                        unreachable = exc
                        return
                    except asyncio.CancelledError as exc:
                        task = asyncio.current_task()
                        if task is not None and task.cancelling():
                            raise  # the relay itself is stopped
                        # A client that cancels its pending confirms when the connection
                        # drops: a refusal, not the end of the relay.
                        refused.append((row["id"], storable_error(exc, 500)))
                        return
                    except Exception as exc:
                        # Anything else, here, fails this producer's row alone: no sibling
                        # is left publishing on a round that is rolled back.
                        error = storable_error(exc, 500)
                        logger.warning(
                            "outbox relay: %s refused message %s (%s); trying again later",
                            row["channel"],
                            row["message_id"],
                            error,
                        )
                        refused.append((row["id"], error))
                        return
                    sent.append(row["id"])

        by_producer: dict[str, list[asyncpg.Record]] = {}
        for row in rows:  # in id order: each producer's chain in publish order
            by_producer.setdefault(row["producer"], []).append(row)
        await asyncio.gather(*(one_producer(chain) for chain in by_producer.values()))
        return sent, refused, unreachable


async def backlog(pool: asyncpg.Pool | asyncpg.Connection) -> dict[str, Any]:
    """Unsent rows (`unsent`), the age of the oldest (`oldest_unsent_s`: the relay's lag) and
    how many of them the broker refused at least once (`refused`)."""
    try:
        row = await pool.fetchrow(queries("outbox.sql")["backlog"])
    except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
        raise StoreError(f"reading the outbox failed: {exc}") from exc
    assert row is not None
    return dict(row)


async def backlog_by_channel(pool: asyncpg.Pool, *, limit: int = 20) -> list[dict[str, Any]]:
    """The backlog per destination channel, the most lagging first, with its latest error."""
    try:
        rows = await pool.fetch(queries("outbox.sql")["backlog_by_channel"], limit)
    except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
        raise StoreError(f"reading the outbox failed: {exc}") from exc
    return [dict(row) for row in rows]


__all__ = [
    "Outgoing",
    "PublishingCompletions",
    "Relay",
    "RelayStats",
    "backlog",
    "backlog_by_channel",
    "with_trace_context",
]
