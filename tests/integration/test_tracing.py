"""OpenTelemetry: a span per message, the completing run's trace id kept with the claim."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aio_pika
import asyncpg
import httpx
import pytest
from fastapi import FastAPI, Request
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedupe_rabbitmq as rabbitmq
from dedupe import App, Context, Worker
from dedupe.asgi import IdempotencyMiddleware
from dedupe.claims.store import ClaimStore
from dedupe.observability.tracing import Tracing, recording
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.webhooks import api_key
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from tests.conftest import delete_channel_everywhere, eventually
from tests.integration.http_server import serving

PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{PRODUCER_TRACE}-00f067aa0ba902b7-01"  # a caller's traceparent


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


# -- traces across the chain: the run's span current in its handler, through the outbox, and
# the receiver's and the middleware's spans ---------------------------------------------------


def sdk() -> tuple[TracerProvider, InMemorySpanExporter]:
    """The SDK with an in-memory exporter, as the process's global provider (which the receiver
    and the middleware use); set once per process, so a second test adds its own exporter."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def ancestors(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> list[int]:
    """The span ids above `span` (its parent, the parent's, ...), among `spans` and one more."""
    by_id = {s.context.span_id: s for s in spans}
    found: list[int] = []
    parent = parent_of(span)
    while parent is not None and len(found) < 50:
        found.append(parent)
        above = by_id.get(parent)
        parent = parent_of(above) if above is not None else None
    return found


async def test_a_chain_is_one_trace_through_the_outbox_with_the_handlers_spans_inside(
    request: pytest.FixtureRequest, db_url: str, amqp_url: str, channel: str
) -> None:
    """A Worker on RabbitMQ: stage 1's span continues the producer's trace and is current in its
    handler (its own span is a child); the message it publishes carries stage 1's
    traceparent through the outbox, so stage 2's span is stage 1's child, in the same trace."""
    provider, exporter = sdk()
    second = f"{channel}-b"
    app = App("chained")
    user_tracer = provider.get_tracer("the-users-code")
    reached: asyncio.Event = asyncio.Event()

    @app.handler(channel)
    async def accept(order: dict[str, int], ctx: Context) -> None:
        with user_tracer.start_as_current_span("user.check_stock"):
            pass
        await ctx.publish(second, {"n": order["n"]})

    @app.handler(second)
    async def ship(order: dict[str, int], ctx: Context) -> None:
        with user_tracer.start_as_current_span("user.ship"):
            reached.set()

    traceparent = f"00-{PRODUCER_TRACE}-00f067aa0ba902b7-01"
    try:
        # The worker as `dedupe-worker run` makes it: its tracing uses the global provider.
        async with Worker(app, database_url=db_url, broker_url=amqp_url, concurrency=4):
            await rabbitmq.publish(
                amqp_url, channel, [(b'{"n": 1}', {"traceparent": traceparent}, "m-1")]
            )
            await asyncio.wait_for(reached.wait(), 30)

            async def both_concluded() -> bool:
                names = {s.name for s in exporter.get_finished_spans()}
                return {"dedupe.process accept", "dedupe.process ship"} <= names

            await eventually(both_concluded, timeout_s=20)
    finally:
        await delete_channel_everywhere(request, second)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    first, stage_two = spans["dedupe.process accept"], spans["dedupe.process ship"]
    assert format(first.context.trace_id, "032x") == PRODUCER_TRACE
    assert parent_of(first) == 0x00F067AA0BA902B7
    assert first.attributes["dedupe.outcome"] == "completed"
    assert parent_of(spans["user.check_stock"]) == first.context.span_id
    assert stage_two.context.trace_id == first.context.trace_id
    assert parent_of(stage_two) == first.context.span_id
    assert parent_of(spans["user.ship"]) == stage_two.context.span_id
    assert stage_two.attributes["dedupe.outcome"] == "completed"
    assert app.hooks == []  # the worker took its tracing hook off again


async def through_the_receiver(
    db_url: str, amqp_url: str, channel: str, key: str, trace_headers: dict[str, str]
) -> tuple[httpx.Response, aio_pika.abc.AbstractIncomingMessage]:
    """One webhook request with these trace headers through a receiver serving HTTP; its
    answer and the message it forwarded (taken off the channel's queue)."""
    from dedupe_receiver import create_receiver

    app = App("hooks")
    app.webhook("shop", verify=api_key({"api-key-1": "tenant-a"}), channel=channel)
    publisher = RabbitMQPublisher(amqp_url)
    receiver = create_receiver(app, database_url=db_url, publisher=publisher)
    async with serving(receiver) as base, httpx.AsyncClient(base_url=base) as client:
        response = await client.post(
            "/webhooks/shop",
            content=b'{"n": 1}',
            headers={
                "content-type": "application/json",
                "idempotency-key": key,
                "authorization": "Bearer api-key-1",
                **trace_headers,
            },
        )
    await publisher.close()
    assert response.status_code == 202, response.text
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        queue = await amqp.declare_queue(channel, passive=True)
        forwarded = await queue.get(timeout=5)
        await forwarded.ack()
    return response, forwarded


async def test_the_receivers_span_continues_the_callers_and_is_the_parent_of_the_workers(
    db_url: str, amqp_url: str, channel: str
) -> None:
    """A webhook request gets a SERVER span, a child of the caller's traceparent; the message
    it forwards carries the receiver span's traceparent, not the caller's."""
    _, exporter = sdk()
    _, forwarded = await through_the_receiver(
        db_url, amqp_url, channel, "w-1", {"traceparent": CALLER}
    )
    [span] = [s for s in exporter.get_finished_spans() if s.name == "dedupe.receive shop"]
    assert span.kind is trace.SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == PRODUCER_TRACE
    assert parent_of(span) == 0x00F067AA0BA902B7
    assert span.attributes["dedupe.key"] == "w-1"
    assert span.attributes["http.response.status_code"] == 202
    assert forwarded.headers["traceparent"] == (
        f"00-{PRODUCER_TRACE}-{span.context.span_id:016x}-01"
    )


async def through_the_middleware(
    db_url: str, endpoint: Any, key: str, *, tracestate: str | None = None, times: int = 1
) -> list[httpx.Response]:
    """POST /orders `times` with the caller's traceparent (and `tracestate`) to `endpoint`
    behind the middleware, served over HTTP; the answers."""
    api = FastAPI()
    api.post("/orders")(endpoint)
    wrapped = IdempotencyMiddleware(
        api,
        dedupe_app=App("shop"),
        database_url=db_url,
        principal_secret="tracing-test-secret-0123456789",
    )
    headers = {"idempotency-key": key, "authorization": "u", "traceparent": CALLER}
    if tracestate is not None:
        headers["tracestate"] = tracestate
    async with serving(wrapped) as base, httpx.AsyncClient(base_url=base) as client:
        return [await client.post("/orders", json={"n": 1}, headers=headers) for _ in range(times)]


async def outbox_headers(db_url: str, channel: str) -> dict[str, str]:
    conn = await asyncpg.connect(db_url)
    try:
        row = await conn.fetchval("SELECT headers FROM dedupe_outbox WHERE channel = $1", channel)
    finally:
        await conn.close()
    return dict(json.loads(row))


async def test_the_middlewares_span_is_the_parent_of_the_endpoints_and_of_its_publishes(
    db_url: str,
) -> None:
    """A keyed request gets a SERVER span continuing the client's trace; the endpoint's own
    span is its child, and what the endpoint publishes carries it on through the outbox."""
    provider, exporter = sdk()
    user_tracer = provider.get_tracer("the-users-code")

    async def create(request: Request) -> dict[str, str]:
        with user_tracer.start_as_current_span("user.create_order"):
            await request.state.idempotency.publish("orders.created", {"id": "o-1"})
        return {"id": "o-1"}

    [response] = await through_the_middleware(db_url, create, "h-1")
    assert response.status_code == 200, response.text
    spans = {s.name: s for s in exporter.get_finished_spans()}
    span = spans["dedupe.http POST"]
    assert span.kind is trace.SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == PRODUCER_TRACE
    assert parent_of(span) == 0x00F067AA0BA902B7
    assert span.attributes["dedupe.outcome"] == "new"
    endpoint = spans["user.create_order"]
    assert span.context.span_id in ancestors(endpoint, exporter.get_finished_spans())
    headers = await outbox_headers(db_url, "orders.created")
    assert headers["traceparent"] == f"00-{PRODUCER_TRACE}-{endpoint.context.span_id:016x}-01"


# without a recording tracer provider (no SDK): no span, the caller's trace context passes on


def test_spans_are_recorded_only_under_a_provider_other_than_the_apis_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The API's proxy (nothing set) and its no-op provider record nothing; an SDK's does."""
    for provider, recorded in (
        (trace.ProxyTracerProvider(), False),
        (trace.NoOpTracerProvider(), False),
        (TracerProvider(), True),
    ):
        monkeypatch.setattr(trace, "get_tracer_provider", lambda provider=provider: provider)
        assert recording() is recorded, provider


async def test_without_a_recording_provider_the_receiver_forwards_the_callers_trace_context(
    db_url: str, amqp_url: str, channel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No span is opened, and the forwarded message carries the caller's traceparent and
    tracestate as they came, so the worker's span (under an SDK of its own) continues the
    caller's trace all the same."""
    _, exporter = sdk()  # installed, but hidden from the receiver below
    monkeypatch.setattr(trace, "get_tracer_provider", trace.NoOpTracerProvider)
    _, forwarded = await through_the_receiver(
        db_url, amqp_url, channel, "w-untraced", {"traceparent": CALLER, "tracestate": "vendor=1"}
    )
    assert not [s for s in exporter.get_finished_spans() if s.name == "dedupe.receive shop"]
    assert (forwarded.headers["traceparent"], forwarded.headers["tracestate"]) == (
        CALLER,
        "vendor=1",
    )


async def test_without_a_recording_provider_the_endpoint_sees_the_callers_trace_context(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind the middleware with no SDK, the endpoint reads the caller's traceparent and
    the request is served as under a tracer."""
    monkeypatch.setattr(trace, "get_tracer_provider", trace.NoOpTracerProvider)
    seen: list[str | None] = []

    async def create(request: Request) -> dict[str, str]:
        seen.append(request.headers.get("traceparent"))
        return {"id": "o-1"}

    first, again = await through_the_middleware(db_url, create, "h-untraced", times=2)
    assert (first.status_code, again.status_code) == (200, 200), first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert seen == [CALLER]


async def test_without_a_recording_provider_the_endpoints_publishes_carry_the_callers_trace(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind the middleware with no SDK, what the endpoint publishes still carries the
    caller's trace context through the outbox, as the API's non-recording span passed it on,
    so the worker behind (with an SDK of its own) continues the caller's trace."""
    monkeypatch.setattr(trace, "get_tracer_provider", trace.NoOpTracerProvider)
    current: list[str] = []

    async def create(request: Request) -> dict[str, str]:
        current.append(format(trace.get_current_span().get_span_context().trace_id, "032x"))
        await request.state.idempotency.publish("orders.created", {"id": "o-1"})
        return {"id": "o-1"}

    [response] = await through_the_middleware(
        db_url, create, "h-untraced-publish", tracestate="vendor=1"
    )
    assert response.status_code == 200, response.text
    assert current == [PRODUCER_TRACE]
    headers = await outbox_headers(db_url, "orders.created")
    assert (headers.get("traceparent"), headers.get("tracestate")) == (CALLER, "vendor=1")
