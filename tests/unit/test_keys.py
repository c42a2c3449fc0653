"""Key derivation: every spec form, fallbacks, and what counts as missing."""

from __future__ import annotations

import pytest

from dedupe.claims.keys import compile_key, derive_key
from dedupe.errors import ConfigurationError, InvalidPayload, KeyMissing
from dedupe.testing.deliveries import make_message


def msg(body: str = "{}", **kwargs: object) -> object:
    return make_message("orders", body, **kwargs)  # type: ignore[arg-type]


def test_message_id_comes_from_the_native_property_first() -> None:
    """message_id prefers the broker's property over the message-id header."""
    derive = compile_key("message_id")
    assert derive(msg(message_id="m-1", headers={"message-id": "h-1"})) == "m-1"
    assert derive(msg(headers={"Message-ID": "h-1"})) == "h-1"


def test_header_lookup_is_case_insensitive() -> None:
    """header:NAME finds the header whatever its case."""
    derive = compile_key("header:Idempotency-Key")
    assert derive(msg(headers={"idempotency-key": "abc"})) == "abc"


def test_body_path_reads_nested_json_values() -> None:
    """body:a.b.c walks objects and list indexes and stringifies scalars."""
    body = '{"order": {"id": 42, "lines": [{"sku": "x"}], "paid": true}}'
    assert compile_key("body:order.id")(msg(body)) == "42"
    assert compile_key("body:order.lines.0.sku")(msg(body)) == "x"
    assert compile_key("body:order.paid")(msg(body)) == "true"
    assert compile_key("body:order.nope")(msg(body)) is None
    assert compile_key("body:order")(msg(body)) is None  # an object is not a key


def test_body_path_on_invalid_json_is_an_invalid_payload() -> None:
    """A body key on a non-JSON body says the payload is invalid, not that the key is missing."""
    with pytest.raises(InvalidPayload):
        compile_key("body:id")(msg("not json"))


def test_fallback_chain_takes_the_first_key_present() -> None:
    """'a|b|c' tries each source in turn, skipping bodies that are not JSON."""
    derive = compile_key("header:Idempotency-Key|body:id|message_id")
    assert derive(msg('{"id": "b"}', message_id="m", headers={"Idempotency-Key": "h"})) == "h"
    assert derive(msg('{"id": "b"}', message_id="m")) == "b"
    assert derive(msg("not json", message_id="m")) == "m"
    assert derive(msg("{}")) is None


def test_kafka_offset_key_needs_the_coordinates() -> None:
    """kafka:offset is topic/partition/offset, absent outside Kafka."""
    derive = compile_key("kafka:offset")
    assert derive(msg(meta={"topic": "t", "partition": 3, "offset": 17})) == "t/3/17"
    assert derive(msg()) is None


def test_callable_specs_are_used_as_they_are() -> None:
    """A callable key spec receives the Message."""
    derive = compile_key(lambda m: m.headers.get("x-key"))
    assert derive(msg(headers={"X-Key": "k"})) == "k"


@pytest.mark.parametrize("spec", ["", "nope", "header:", "body:", "body:a..b", "kafka:topic", 42])
def test_malformed_specs_are_refused_at_compile_time(spec: object) -> None:
    """A bad spec fails when the handler is registered, not when a message arrives."""
    with pytest.raises(ConfigurationError):
        compile_key(spec)  # type: ignore[arg-type]


def test_missing_keys_raise_key_missing() -> None:
    """derive_key turns None and '' into KeyMissing; what the claims table can hold is
    dedupe.claims.values.check_claimable's to say (tests/unit/test_values.py)."""
    derive = compile_key("header:k")
    with pytest.raises(KeyMissing):
        derive_key(derive, msg())
    with pytest.raises(KeyMissing):
        derive_key(derive, msg(headers={"k": ""}))
    assert derive_key(derive, msg(headers={"k": "ok"})) == "ok"
