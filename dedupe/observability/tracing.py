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

A message that is run has its span opened when its run begins (the app hook's "claimed"
stage, registered by `Tracing.watch(app)`) and made current while its handler runs: the
handler's own spans are its children, and so is whatever it publishes (`ctx.publish` stores
the span's `traceparent` with the outbox row, dedupe.effects.outbox.with_trace_context), so
the next stage's span continues the trace. The webhook receiver and the HTTP middleware open a
SERVER span per request (`server_span`), which the worker's span of a forwarded message, or
the endpoint's own spans, are children of; without an SDK's tracer provider (`recording()`)
they open none and the request's own trace headers pass on as they came.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from dedupe.app import App
from dedupe.claims.records import KeyId
from dedupe.claims.store import ClaimStore
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.pipeline.observers import FlushingObserver, outcome_of
from dedupe.sql import queries
from dedupe.transport import Settlement

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - depends on the install
    trace = None  # type: ignore[assignment]
    propagate = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)
MAX_PENDING = 10_000

# The otel context token of the run span this task made current (reset once the run is done).
_attached: contextvars.ContextVar[Any] = contextvars.ContextVar("dedupe_run_span", default=None)


def available() -> bool:
    """Whether opentelemetry-api is installed."""
    return trace is not None


def recording() -> bool:
    """Whether spans are recorded: a tracer provider other than the API's own (an SDK's) is
    set. Without one, a SERVER span would only pass the caller's trace context on, which the
    request's own `traceparent` header already does, so the receiver and the middleware open
    none (about a tenth of a new webhook's CPU). Asked per request: a provider set later is
    used from then on."""
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


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
        # Spans of runs under way, by (message, scope): opened at the claim, ended concluded.
        self._running: dict[tuple[int, str], Any] = {}
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
        span = self._running.pop((id(message), scope), None)
        if span is not None:  # a run's: opened when it began
            span.update_name(f"dedupe.process {handler}")
            span.set_attributes(attributes)
        else:
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

    # -- a run's span, current while its handler runs -------------------------------------

    def watch(self, app: App) -> Callable[[], None]:
        """Register the app hook that opens a run's span when its claim is ours and makes it
        current for its handler (before the Processor is made: it reads the hooks then);
        returns what unregisters it."""
        app.hook("claimed")(self._run_began)
        entry = app.hooks[-1]

        def unwatch() -> None:
            with contextlib.suppress(ValueError):
                app.hooks.remove(entry)

        return unwatch

    async def _run_began(self, stage: str, message: Message, scope: str, key: str) -> None:
        assert trace is not None and propagate is not None and otel_context is not None
        _detach()  # a run before this one in this task that never got to ran()
        span = self._running.get((id(message), scope))
        if span is None:  # not a later attempt of a run under way
            if len(self._running) >= MAX_PENDING:
                return
            span = self.tracer.start_span(
                f"dedupe.process {scope}",
                context=propagate.extract(dict(message.headers)),
                kind=trace.SpanKind.CONSUMER,
                attributes={"dedupe.scope": scope, "dedupe.key": key},
            )
            if not span.is_recording():
                span.end()
                return
            self._running[(id(message), scope)] = span
        _attached.set(otel_context.attach(trace.set_span_in_context(span)))

    def ran(self, handler: str, seconds: float, *, ok: bool) -> None:
        """The handler's attempt is over (in the run's task): its span is current no more."""
        _detach()

    async def __aexit__(self, *exc: object) -> None:
        await super().__aexit__(*exc)
        running, self._running = self._running, {}
        for span in running.values():  # runs never concluded (the worker stopped under them)
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


def _detach() -> None:
    token = _attached.get()
    if token is not None and otel_context is not None:
        _attached.set(None)
        otel_context.detach(token)


# -- the receiver's and the middleware's spans ---------------------------------------------


@contextlib.contextmanager
def server_span(
    name: str, headers: Mapping[str, str], attributes: Mapping[str, Any] | None = None
) -> Iterator[Any]:
    """A SERVER span around one HTTP request, current inside the block, continuing the
    client's trace (its `traceparent`); yields it (None without OpenTelemetry). An exception
    is recorded on it and goes on."""
    if trace is None or propagate is None:
        yield None
        return
    tracer = trace.get_tracer("dedupe-worker")
    with tracer.start_as_current_span(
        name,
        context=propagate.extract(dict(headers)),
        kind=trace.SpanKind.SERVER,
        attributes=dict(attributes or {}),
    ) as span:
        yield span


@contextlib.contextmanager
def callers_context(headers: Mapping[str, str]) -> Iterator[None]:
    """Without a recording tracer (no SERVER span): the caller's span context (its
    `traceparent`) current inside the block, as the API's non-recording span made it, so that
    what the endpoint publishes (ctx.publish's outbox rows, with_trace_context) and its own code
    carry the caller's trace on. Nothing without OpenTelemetry or a valid trace context."""
    if trace is None or propagate is None or otel_context is None:
        yield
        return
    span = trace.get_current_span(propagate.extract(dict(headers)))
    if not span.get_span_context().is_valid:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def callers_headers(scope: Mapping[str, Any]) -> dict[str, str] | None:
    """An ASGI scope's headers as text (asgi_headers), for callers_context to make the
    caller's span current; None when the request carries none of the headers the propagator in
    use reads (most requests: nothing to find, no headers decoded). Only the W3C propagators
    (the default: `traceparent`, `tracestate`, `baggage`) are known to read no more than the
    fields they name (B3's, say, read `b3` and `x-b3-*` whichever they name): with any other,
    the headers are always passed on. None without OpenTelemetry."""
    if propagate is None:
        return None
    fields = _propagator_fields()
    if fields is not None:
        for name, _ in scope.get("headers", ()):
            if bytes(name).lower() in fields:
                break
        else:
            return None
    return asgi_headers(scope)


_fields: tuple[object, frozenset[bytes] | None] = (None, None)


def _propagator_fields() -> frozenset[bytes] | None:
    """The header names the global propagator reads, lower case, when it is made of the W3C
    propagators only; None for any other (which may read more than its fields). Asked again
    when another propagator is set."""
    global _fields
    assert propagate is not None
    propagator = propagate.get_global_textmap()
    if _fields[0] is not propagator:
        _fields = (propagator, _w3c_fields(propagator))
    return _fields[1]


def _w3c_fields(propagator: object) -> frozenset[bytes] | None:
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    members: Any = [propagator]
    if type(propagator) is CompositePropagator:
        members = getattr(propagator, "_propagators", None)  # no public accessor
        if not isinstance(members, list | tuple):
            return None
    names: set[bytes] = set()
    for member in members:
        if type(member) not in (TraceContextTextMapPropagator, W3CBaggagePropagator):
            return None
        names.update(str(field).lower().encode("latin-1") for field in member.fields)
    return frozenset(names)


def annotate(span: Any, **attributes: Any) -> None:
    """Set attributes on `span` (from server_span; None: nothing), leaving out None values."""
    if span is not None and span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def annotate_current(**attributes: Any) -> None:
    """Set attributes on the current span, if OpenTelemetry records one."""
    if trace is not None:
        annotate(trace.get_current_span(), **attributes)


def trace_headers() -> dict[str, str]:
    """The W3C trace context of the current span (`traceparent`, `tracestate`), to forward;
    empty without OpenTelemetry or a recording span."""
    if propagate is None:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def with_trace_headers(scope: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """An ASGI scope whose `traceparent` (and `tracestate`) are the current span's, so that the
    app's own instrumentation (which reads them from the request) continues from it."""
    ours = trace_headers()
    if not ours:
        return scope
    kept = [
        (name, value)
        for name, value in scope.get("headers", [])
        if bytes(name).lower() not in (b"traceparent", b"tracestate")
    ]
    added = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in ours.items()]
    return {**scope, "headers": kept + added}


def asgi_headers(scope: Mapping[str, Any]) -> dict[str, str]:
    """An ASGI scope's headers as text (the last of a repeated one)."""
    return {
        bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
        for name, value in scope.get("headers", [])
    }


__all__ = [
    "Tracing",
    "annotate",
    "annotate_current",
    "asgi_headers",
    "available",
    "callers_context",
    "callers_headers",
    "recording",
    "server_span",
    "trace_headers",
    "tracer_for",
    "with_trace_headers",
]
