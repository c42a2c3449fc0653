"""OpenTelemetry: a span per message, the completing run's trace id kept with the claim."""

from __future__ import annotations

import json

import asyncpg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dedupe import App
from dedupe.claims.store import ClaimStore
from dedupe.observability.tracing import Tracing
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message

PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def delivery(key: str, body: str = '{"n": 1}', trace: str | None = None) -> MemoryDelivery:
    headers = {"traceparent": f"00-{trace}-00f067aa0ba902b7-01"} if trace else {}
    return MemoryDelivery(make_message("orders", body, message_id=key, headers=headers))


async def test_each_message_gets_a_span_and_a_duplicate_points_at_the_original_run(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Spans carry scope, key and outcome; the duplicate's span names the completing trace."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = App("traced")

    @app.handler("orders")
    async def place(order: dict[str, int]) -> None:
        pass

    tracing = Tracing(store, tracer_provider=provider, interval_s=0.05)
    async with tracing, Processor(app, store, observers=[tracing]) as processor:
        await processor.process("orders", [delivery("o-1", trace=PRODUCER_TRACE)])
        await tracing.flush()
        await processor.process("orders", [delivery("o-1")])  # a duplicate, new trace
        await processor.process("orders", [delivery("o-1", body='{"n": 2}')])  # conflict
    spans = exporter.get_finished_spans()
    by_outcome = {span.attributes["dedupe.outcome"]: span for span in spans}
    assert set(by_outcome) == {"completed", "duplicate", "conflict"}
    done = by_outcome["completed"]
    assert done.name == "dedupe.process place"
    assert done.attributes["dedupe.scope"] == "traced.place"
    assert done.attributes["dedupe.key"] == "o-1"
    assert format(done.context.trace_id, "032x") == PRODUCER_TRACE  # continues the producer's
    stored = await db.fetchval("SELECT trace_id FROM dedupe_claims WHERE key = 'o-1'")
    assert stored == PRODUCER_TRACE
    duplicate = by_outcome["duplicate"]
    assert format(duplicate.context.trace_id, "032x") != PRODUCER_TRACE
    assert duplicate.attributes["dedupe.original_trace_id"] == PRODUCER_TRACE
    assert by_outcome["conflict"].attributes["dedupe.reason"] == "key_conflict"
    assert not by_outcome["conflict"].status.is_ok


async def test_without_a_configured_sdk_nothing_is_recorded_or_written(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The API alone makes non-recording spans: no trace id is stored."""
    from opentelemetry.trace import NoOpTracerProvider

    app = App("quiet")

    @app.handler("orders")
    async def place(order: dict[str, int]) -> None:
        pass

    tracing = Tracing(store, tracer_provider=NoOpTracerProvider())
    async with tracing, Processor(app, store, observers=[tracing]) as processor:
        await processor.process("orders", [delivery("q-1")])
    assert await db.fetchval("SELECT trace_id FROM dedupe_claims") is None
    assert json.loads(await db.fetchval("SELECT count(*)::text FROM dedupe_claims")) == 1
