"""Fingerprints: what "the same payload" means for conflict detection, compiled at registration."""

from __future__ import annotations

import hashlib

import pytest

from dedupe.claims.fingerprints import (
    KEEP_PAYLOAD_MAX_BYTES,
    RAW,
    Fingerprint,
    claim_request,
    compile_fingerprint,
)
from dedupe.errors import ConfigurationError, InvalidPayload
from dedupe.message import Message
from dedupe.testing.deliveries import make_message


def digest(fingerprint: Fingerprint, body: str | bytes) -> bytes:
    return fingerprint.digest(make_message("c", body))


def test_the_raw_fingerprint_is_the_sha256_of_the_body_bytes() -> None:
    """The default: today's payload hash, and no scheme stored with the claim."""
    raw = compile_fingerprint("raw")
    assert raw is RAW and raw.stored is None
    assert digest(raw, b'{"a":1}') == hashlib.sha256(b'{"a":1}').digest()
    assert digest(raw, b'{"a":1}') != digest(raw, b'{"a": 1}')


def test_json_fingerprints_ignore_key_order_whitespace_and_number_spelling() -> None:
    """A re-serialized body is the same payload; 1, 1.0 and 1e0 are one number."""
    fingerprint = compile_fingerprint("json")
    first = digest(fingerprint, '{"id": "o-1", "amount": 10, "items": [{"sku": "a", "qty": 1}]}')
    for same in (
        '{"items":[{"qty":1,"sku":"a"}],"amount":10,"id":"o-1"}',
        '{\n  "amount": 10.0,\n  "id": "o-1",\n  "items": [ {"sku": "a", "qty": 1e0} ]\n}',
        '{"id": "o-\\u0031", "amount": 1E1, "items": [{"sku": "a", "qty": 1.000}]}',
    ):
        assert digest(fingerprint, same) == first, same
    assert fingerprint.stored == "json"


def test_json_fingerprints_tell_different_values_apart() -> None:
    """Another value, type, array order or field is another payload."""
    fingerprint = compile_fingerprint("json")
    bodies = [
        '{"amount": 10}',
        '{"amount": 11}',
        '{"amount": "10"}',
        '{"amount": 10, "coupon": null}',
        '{"amount": 10.000000000000000000000000000001}',
        "[1, 2]",
        "[2, 1]",
        '"10"',
        "true",
        "null",
    ]
    digests = {digest(fingerprint, body) for body in bodies}
    assert len(digests) == len(bodies)
    assert digest(fingerprint, "0") == digest(fingerprint, "-0.0")


def test_excluded_paths_do_not_count() -> None:
    """A top-level field, a nested one, one in every array element, or a position."""
    fingerprint = compile_fingerprint(
        "json", exclude=("sent_at", "meta.trace", "items.*.seen", "tags.0")
    )
    first = digest(
        fingerprint,
        '{"id": 1, "sent_at": "t1", "meta": {"trace": "x", "v": 2},'
        ' "items": [{"sku": "a", "seen": 1}, {"sku": "b", "seen": 2}], "tags": ["t0", "t1"]}',
    )
    same = (
        '{"id": 1, "meta": {"v": 2, "trace": "y"},'
        ' "items": [{"sku": "a"}, {"sku": "b", "seen": 9}], "tags": ["zz", "t1"]}'
    )
    assert digest(fingerprint, same) == first
    other = '{"id": 1, "meta": {"v": 3}, "items": [{"sku": "a"}, {"sku": "b"}], "tags": [0, "t1"]}'
    assert digest(fingerprint, other) != first
    assert fingerprint.stored == 'json exclude=["items.*.seen","meta.trace","sent_at","tags.0"]'


def test_the_scheme_of_an_exclude_list_does_not_depend_on_its_order() -> None:
    """("a", "b") and ("b", "a", "a") leave out the same paths: one scheme."""
    assert (
        compile_fingerprint("json", exclude=("a", "b")).stored
        == compile_fingerprint("json", exclude=["b", "a", "a"]).stored
    )


def test_a_body_that_is_not_json_is_fingerprinted_by_its_bytes_under_json() -> None:
    """Not JSON (or nested deeper than 256 levels): as raw would, so the claim goes ahead and
    the handler's decoding decides."""
    fingerprint = compile_fingerprint("json")
    for body in (b"{not json", b"\xff\xfe", b"NaN", b"[" * 300 + b"]" * 300):
        assert digest(fingerprint, body) == hashlib.sha256(body).digest()
    spaced = b"[ " * 200 + b"]" * 200  # within the limit: compared as JSON
    assert digest(fingerprint, spaced) == hashlib.sha256(b"[" * 200 + b"]" * 200).digest()


def test_a_callable_fingerprint_hashes_what_it_returns() -> None:
    """(Message) -> bytes; its scheme is its qualified name."""

    def order_id(message: Message) -> bytes:
        return message.body.split(b",")[0]

    fingerprint = compile_fingerprint(order_id)
    assert digest(fingerprint, b"o-1,a") == digest(fingerprint, b"o-1,b")
    assert digest(fingerprint, b"o-1,a") == hashlib.sha256(b"o-1").digest()
    assert fingerprint.stored == (
        "callable tests.unit.test_fingerprints:"
        "test_a_callable_fingerprint_hashes_what_it_returns.<locals>.order_id"
    )


def test_a_callable_fingerprint_that_fails_makes_the_payload_invalid() -> None:
    """An exception or a value that is not bytes: InvalidPayload, never a crashed batch."""

    def broken(message: Message) -> bytes:
        raise KeyError("id")

    with pytest.raises(InvalidPayload, match="KeyError"):
        digest(compile_fingerprint(broken), b"{}")
    with pytest.raises(InvalidPayload, match="str"):
        digest(compile_fingerprint(lambda message: "text"), b"{}")  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    ("spec", "exclude", "match"),
    [
        ("xml", (), "use 'raw'"),
        ("JSON", (), "use 'raw'"),
        (42, (), "use 'raw'"),
        ("raw", ("sent_at",), "needs fingerprint='json'"),
        (lambda m: m.body, ("sent_at",), "needs fingerprint='json'"),
        ("json", "sent_at", r"a tuple: fingerprint_exclude=\('sent_at',\)"),
        ("json", ("",), "empty segment"),
        ("json", ("meta..trace",), "empty segment"),
        ("json", ("meta.",), "empty segment"),
        ("json", (" sent_at",), "spaces"),
        ("json", ("*",), "the whole body"),
        ("json", ("*.*",), "the whole body"),
        ("json", (1,), "strings"),
        ("json", tuple(f"f{i}" for i in range(33)), "at most 32"),
        ("json", ("x" * 501,), "500 characters"),
    ],
)
def test_registration_refuses_a_fingerprint_it_cannot_use(
    spec: object, exclude: object, match: str
) -> None:
    """Each error says what to write instead."""
    with pytest.raises(ConfigurationError, match=match):
        compile_fingerprint(spec, exclude=exclude, where="handler 'h'")  # type: ignore[arg-type]


def test_a_claim_request_carries_the_scheme_the_raw_hash_and_the_kept_payload() -> None:
    """Under raw only the hash; under json the raw hash too; the body when kept and small."""
    message = make_message("c", b'{"a": 1}')
    raw = claim_request("s", "k", message, RAW)
    assert (raw.payload_hash, raw.fingerprint, raw.raw_hash, raw.payload) == (
        message.payload_hash,
        None,
        None,
        None,
    )
    fingerprint = compile_fingerprint("json")
    kept = claim_request("s", "k", message, fingerprint, keep_payload=True)
    assert kept.payload_hash == hashlib.sha256(b'{"a":1e0}').digest()
    assert (kept.fingerprint, kept.raw_hash, kept.payload) == (
        "json",
        message.payload_hash,
        b'{"a": 1}',
    )
    large = make_message("c", b"x" * (KEEP_PAYLOAD_MAX_BYTES + 1))
    assert claim_request("s", "k", large, fingerprint, keep_payload=True).payload is None
