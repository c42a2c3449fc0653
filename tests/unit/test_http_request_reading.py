"""What IdempotencyMiddleware reads of a request without building its dedupe.Message: the
principal of a `header:NAME` scope (keys.PrincipalSource) and whether a trace context came
(tracing.callers_headers). Each must read what the general path reads."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import propagate
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dedupe.asgi.keys import (
    PrincipalSource,
    RequestLine,
    compile_principal,
    principal_of,
    request_message,
)
from dedupe.claims.keys import compile_key
from dedupe.observability import tracing

LINE = RequestLine("POST", b"/orders", b"")
BODY = b'{"sku": "a"}'

HEADER_LISTS = [
    [(b"authorization", b"Bearer a")],
    [],
    [(b"authorization", b"")],
    [(b"host", b"x"), (b"authorization", b"one"), (b"authorization", b"two")],
    # Spellings a server that does not lower-case names passes on: the Message's headers keep
    # the last value of each spelling, then the last spelling first seen wins.
    [(b"authorization", b"a"), (b"Authorization", b"b"), (b"authorization", b"c")],
    [(b"Authorization", b"b"), (b"AUTHORIZATION", b"x"), (b"authorization", b"c")],
    [(b"authorization", "caf\u00e9".encode("latin-1")), (b"x-other", b"\xff")],
    [(b"\xc1uthorization", b"not it"), (b"authorizatio", b"nor this")],
]


@pytest.mark.parametrize("headers", HEADER_LISTS)
@pytest.mark.parametrize(
    "spec", ["header:Authorization", "header:authorization", " header:AUTHORIZATION "]
)
def test_a_header_scope_reads_the_principal_the_message_gives(
    headers: list[tuple[bytes, bytes]], spec: str
) -> None:
    source = compile_principal(spec)
    assert source.header == b"authorization"
    general = PrincipalSource(compile_key(spec))
    expected = principal_of(compile_key(spec), request_message(LINE, headers, BODY))
    assert source.of(LINE, headers, BODY) == general.of(LINE, headers, BODY) == expected


@pytest.mark.parametrize(
    "spec", ["header:Authorization|header:Cookie", "body:user.id", "header:caf\u00e9", "message_id"]
)
def test_other_scopes_read_the_message(spec: str) -> None:
    assert compile_principal(spec).header is None


def test_a_callable_scope_reads_the_message() -> None:
    seen = []

    def who(message: object) -> str:
        seen.append(message)
        return "u-1"

    source = compile_principal(who)
    assert source.header is None
    assert source.of(LINE, [(b"authorization", b"x")], BODY) == "u-1"
    assert len(seen) == 1


def _scope(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": "http", "headers": list(headers)}


def test_a_request_without_trace_headers_has_no_context_to_carry() -> None:
    assert tracing.callers_headers(_scope((b"host", b"x"), (b"authorization", b"t"))) is None


@pytest.mark.parametrize("name", [b"traceparent", b"Tracestate", b"baggage"])
def test_a_field_of_the_propagator_carries_the_headers_on(name: bytes) -> None:
    headers = tracing.callers_headers(_scope((b"host", b"x"), (name, b"v")))
    assert headers == {"host": "x", name.decode().lower(): "v"}


class _B3Like(TextMapPropagator):
    """A propagator that reads more than the fields it names (as B3's do: `b3` and `x-b3-*`)."""

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        return context

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        return None

    @property
    def fields(self) -> set[str]:
        return {"X-B3-TraceId"}


@pytest.mark.parametrize(
    "propagator",
    [_B3Like(), CompositePropagator([TraceContextTextMapPropagator(), _B3Like()])],
    ids=["alone", "beside the W3C one"],
)
def test_with_a_propagator_not_the_w3c_ones_the_headers_are_always_passed_on(
    propagator: TextMapPropagator,
) -> None:
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(propagator)
    try:
        for headers in ([(b"b3", b"1-2")], [(b"host", b"x")], [(b"traceparent", b"v")]):
            expected = {k.decode(): v.decode() for k, v in headers}
            assert tracing.callers_headers(_scope(*headers)) == expected
    finally:
        propagate.set_global_textmap(before)
    assert tracing.callers_headers(_scope((b"host", b"x"))) is None


def test_the_w3c_propagators_alone_read_their_fields() -> None:
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(TraceContextTextMapPropagator())
    try:
        assert tracing.callers_headers(_scope((b"baggage", b"k=v"))) is None
        assert tracing.callers_headers(_scope((b"traceparent", b"v"))) == {"traceparent": "v"}
    finally:
        propagate.set_global_textmap(before)
