"""The envelope's headers and the per-message records: values, cheap to make."""

from __future__ import annotations

from dedupe.claims.records import Claim, ClaimRequest, Fence, KeyId
from dedupe.claims.verdicts import Duplicate, Ours
from dedupe.message import Headers


def test_headers_get_is_case_insensitive_and_takes_a_default() -> None:
    headers = Headers({"Message-ID": "m1", "x-none": None, "raw": b"\xffa"})
    assert headers.get("message-id") == "m1"
    assert headers.get("MESSAGE-ID") == "m1"
    assert headers.get("absent") is None
    assert headers.get("absent", "d") == "d"
    assert headers.get("x-none", "d") == "d"  # a None value is no header
    assert headers.get("RAW") == "\ufffda"
    assert headers["Raw"] == "\ufffda"


def test_the_records_compare_and_hash_by_value_as_frozen_ones_did() -> None:
    a, b = Fence("s", "k", 7), Fence("s", "k", 7)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert Fence("s", "k", 8) != a
    request = ClaimRequest("s", "k", b"h", payload=b"one")
    # The kept payload is not part of the value (compare=False), as before.
    assert request == ClaimRequest("s", "k", b"h", payload=b"two")
    assert hash(request) == hash(ClaimRequest("s", "k", b"h"))
    assert Ours(a, 1, False, False) == Ours(b, 1, False, False)
    assert {Duplicate("completed", None): 1}[Duplicate("completed", None)] == 1
    claim = Claim("s", "k", 7, 1)
    assert claim.owned and not Claim("s", "k", None, 1).owned


def test_a_key_has_one_identity_in_every_record_that_names_it() -> None:
    """ClaimRequest, Claim and Fence of one key answer the same KeyId, equal (and hashed) as
    the plain (scope, key) tuple the store's rows give."""
    request = ClaimRequest("shop.charge", "k-1", b"h")
    claim = Claim(scope="shop.charge", key="k-1", token=7, attempts=1)
    fence = Fence("shop.charge", "k-1", 7)
    assert request.ident == claim.ident == fence.ident == KeyId("shop.charge", "k-1")
    assert {fence.ident} == {("shop.charge", "k-1")}
    assert fence.ident.scope == "shop.charge" and fence.ident.key == "k-1"
