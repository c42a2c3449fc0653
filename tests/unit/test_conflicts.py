"""Conflict reports: both fingerprints and, when both payloads are known, the paths that differ,
with their values redacted as the logs redact them (never shown)."""

from __future__ import annotations

import json

from dedupe.claims.conflicts import MAX_CHANGES, ConflictReport, json_diff, report
from dedupe.claims.fingerprints import RAW, Fingerprint, claim_request, compile_fingerprint
from dedupe.claims.records import Reason
from dedupe.testing.deliveries import make_message
from dedupe.transport import Action, Settlement, dead_letter_headers


def conflict(
    first: str | bytes | None,
    second: str | bytes,
    fingerprint: Fingerprint = RAW,
    *,
    keep_payload: bool = True,
) -> ConflictReport:
    """The report of `second` meeting a claim made for `first` (None: not kept)."""
    message = make_message("orders", second, message_id="m-2", headers={"X-Tenant": "a"})
    request = claim_request("shop.place", "k", message, fingerprint, keep_payload=keep_payload)
    claimed = claim_request(
        "shop.place", "k", make_message("orders", first or b"?"), fingerprint, keep_payload=True
    )
    return report(
        request,
        message,
        fingerprint,
        claimed_fingerprint=claimed.fingerprint,
        claimed_hash=claimed.payload_hash,
        claimed_payload=None if first is None else claimed.payload,
        keep_payload=keep_payload,
    )


def test_the_diff_names_the_paths_that_differ_and_never_their_values() -> None:
    """Changed, added and removed members, array elements by position; no value anywhere."""
    first = {"amount": 1000, "note": "card 4242", "items": [{"sku": "a"}], "ok": True}
    second = {"amount": 1200, "coupon": "SECRET10", "items": [{"sku": "b"}, {"sku": "c"}]}
    changes, more = json_diff(first, second)
    assert changes == [
        "~ amount (number)",
        "+ coupon (string)",
        "~ items.0.sku (string)",
        "+ items.1 (object)",
        "- note (string)",
        "- ok (boolean)",
    ]
    assert more == 0
    text = json.dumps(changes)
    assert not any(secret in text for secret in ("4242", "SECRET10", "1000", "1200"))


def test_the_diff_spots_type_changes_and_compares_numbers_by_value() -> None:
    """1 and 1.0 are one number; 1 and "1" or true are not."""
    changes, _ = json_diff({"a": 1, "b": 1, "c": 1, "d": [1]}, {"a": 1.0, "b": "1", "c": True})
    assert changes == ["~ b (number -> string)", "~ c (number -> boolean)", "- d (array)"]
    assert json_diff([1, 2], [1, 2]) == ([], 0)
    assert json_diff("a", 1) == (["~ (the whole body) (string -> number)"], 0)


def test_the_diff_is_bounded() -> None:
    """At most MAX_CHANGES paths, then how many more."""
    changes, more = json_diff({}, {f"f{i:03d}": i for i in range(MAX_CHANGES + 5)})
    assert len(changes) == MAX_CHANGES and more == 5


def test_a_conflict_report_carries_both_fingerprints_and_the_diff_under_the_scheme() -> None:
    """The diff leaves out what the fingerprint leaves out; headers on the dead letter."""
    fingerprint = compile_fingerprint("json", exclude=("sent_at",))
    found = conflict('{"n": 1, "sent_at": "10:00"}', '{"n": 2, "sent_at": "10:05"}', fingerprint)
    assert found.changes == ("~ n (number)",)
    scheme = 'json exclude=["sent_at"]'
    assert found.fingerprint.startswith(f"{scheme} ") and found.claimed.startswith(f"{scheme} ")
    assert found.fingerprint != found.claimed
    assert found.payload == b'{"n": 2, "sent_at": "10:05"}'
    assert (found.channel, found.message_id, found.headers) == ("orders", "m-2", {"X-Tenant": "a"})
    settlement = Settlement(
        Action.DEAD_LETTER, reason=Reason.KEY_CONFLICT, scope="shop.place", key="k", conflict=found
    )
    headers = dead_letter_headers(settlement)
    assert headers["x-dedupe-fingerprint"] == found.fingerprint
    assert headers["x-dedupe-claimed-fingerprint"] == found.claimed
    assert headers["x-dedupe-diff"] == "~ n (number)"
    assert "n (number)" in found.event_detail() and len(found.event_detail()) <= 300


def test_a_conflict_without_the_first_payload_says_why_there_is_no_diff() -> None:
    """Not kept, or not JSON: no diff, and a note saying so."""
    unknown = conflict(None, '{"n": 2}')
    assert unknown.changes is None
    assert "kept no payload" in (unknown.note or "")
    binary = conflict(b"\x00\x01", b"\x00\x02")
    assert binary.changes is None and "not both JSON" in (binary.note or "")
    not_kept = conflict('{"n": 1}', '{"n": 2}', keep_payload=False)
    assert not_kept.changes == ("~ n (number)",)  # the message itself is known, so a diff
    assert not_kept.payload is None  # but the second payload is not kept


def test_the_same_json_value_under_raw_suggests_the_json_fingerprint() -> None:
    """Only the bytes differ: the note says which fingerprint would take it as a retry."""
    found = conflict('{"n": 1, "a": 2}', '{"a":2,"n":1.0}')
    assert found.changes == ()
    assert "fingerprint='json'" in (found.note or "")
    assert dead_letter_headers(
        Settlement(Action.DEAD_LETTER, reason=Reason.KEY_CONFLICT, conflict=found)
    )["x-dedupe-diff"] == (found.note or "")
