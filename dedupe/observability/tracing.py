"""Optional OpenTelemetry tracing (the `otel` extra): a span per message and handler.

Without opentelemetry-api installed, `tracer_for` returns None and nothing is traced. With
the API but no SDK configured, spans are not recorded and nothing is written either.

Each span (`dedupe.process <handler>`, kind CONSUMER) continues the producer's trace when
the message carries a W3C `traceparent` header, starts when its batch arrived and ends when
the pipeline concluded its outcome, with the attributes `dedupe.scope`, `dedupe.key`,
`dedupe.outcome`, `dedupe.reason`, `messaging.message.id` and `dedupe.attempt`. The trace id of
the run that completed a key is stored with the claim (`trace_id`); a duplicate's span gets it as
`dedupe.original_trace_id`, so it points at the run that did the work. Both writes are
batched every `interval_s` by a background task, never made per message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dedupe.claims.records import KeyId
from dedupe.claims.store import ClaimStore
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.pipeline.observers import FlushingObserver, outcome_of
from dedupe.sql import queries
from dedupe.transport import Settlement

try:
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - depends on the install
    trace = None  # type: ignore[assignment]
    propagate = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)
MAX_PENDING = 10_000


def available() -> bool:
    """Whether opentelemetry-api is installed."""
    return trace is not None


def tracer_for(
    store: ClaimStore, *, tracer_provider: Any = None, interval_s: float = 0.5
) -> Tracing | None:
    """A tracing observer when OpenTelemetry is installed, else None."""
    if not available():
        return None
    return Tracing(store, tracer_provider=tracer_provider, interval_s=interval_s)


class Tracing(FlushingObserver):
    """Records a span per message concluded; an async context manager for its writer task."""

    task_name = "dedupe-tracing"

    def __init__(self, store: ClaimStore, *, tracer_provider: Any = None, interval_s: float = 0.5):
        assert trace is not None
        self.store = store
        self.interval_s = interval_s
        self.tracer = trace.get_tracer("dedupe-worker", tracer_provider=tracer_provider)
        self._completed: list[tuple[str, str, str]] = []
        self._duplicates: list[tuple[str, str, Any]] = []
        self._q = queries("operations.sql")
        # One flush at a time: a flush asked for while the background one writes waits for it,
        # so a duplicate's span never looks for a trace id still being written.
        self._flushing = asyncio.Lock()

    def concluded(
        self,
        handler: str,
        scope: str,
        key: str,
        message: Message,
        settlement: Settlement,
        started: float,
    ) -> None:
        assert trace is not None and propagate is not None
        outcome = outcome_of(settlement)
        attributes: dict[str, Any] = {
            "dedupe.handler": handler,
            "dedupe.scope": scope,
            "dedupe.key": key,
            "dedupe.outcome": outcome,
            "dedupe.attempt": message.attempt,
            "messaging.destination.name": message.channel,
        }
        if message.message_id:
            attributes["messaging.message.id"] = message.message_id
        if settlement.reason is not None:
            attributes["dedupe.reason"] = str(settlement.reason)
        start_ns = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        span = self.tracer.start_span(
            f"dedupe.process {handler}",
            context=propagate.extract(dict(message.headers)),
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
            start_time=start_ns,
        )
        if not span.is_recording():
            span.end()
            return
        if settlement.action.value == "dead_letter":
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(settlement.reason)))
        if outcome == "completed" and len(self._completed) < MAX_PENDING:
            trace_id = format(span.get_span_context().trace_id, "032x")
            self._completed.append((scope, key, trace_id))
            span.end()
        elif outcome == "duplicate" and len(self._duplicates) < MAX_PENDING:
            self._duplicates.append((scope, key, span))  # ended once its origin is known
        else:
            span.end()

    async def flush(self) -> None:
        """Store completed runs' trace ids; point duplicates' spans at them and end those."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        completed, self._completed = self._completed, []
        duplicates, self._duplicates = self._duplicates, []
        try:
            if completed:
                columns = [list(c) for c in zip(*completed, strict=True)]
                await self.store.pool.execute(self._q["set_trace_ids"], *columns)
            if duplicates:
                rows = await self.store.pool.fetch(
                    self._q["trace_ids"], [d[0] for d in duplicates], [d[1] for d in duplicates]
                )
                origins = {KeyId(r["scope"], r["key"]): r["trace_id"] for r in rows}
                for scope, key, span in duplicates:
                    origin = origins.get(KeyId(scope, key))
                    if origin:
                        span.set_attribute("dedupe.original_trace_id", origin)
        except Exception as exc:
            raise StoreError(f"could not record trace ids: {exc}") from exc
        finally:
            for _, _, span in duplicates:
                span.end()


__all__ = ["Tracing", "available", "tracer_for"]
