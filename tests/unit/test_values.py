"""Values PostgreSQL cannot hold are caught per message, before any statement is sent."""

from __future__ import annotations

import json

import pytest

from dedupe.claims.values import (
    MAX_KEY_LENGTH,
    check_claimable,
    encode_result,
    storable_json,
    storable_text,
)
from dedupe.errors import InvalidKey


@pytest.mark.parametrize(
    ("scope", "key", "says"),
    [
        ("shop.charge", "a\x00b", "NUL"),
        ("shop.charge", "a\ud800b", "lone surrogate"),
        ("shop.charge", "k" * (MAX_KEY_LENGTH + 1), "characters long"),
        ("shop.charge/" + "t" * 4000, "k", "scope is"),
        ("shop.charge/a\x00", "k", "scope contains a NUL"),
        ("s" * 500, "\U0001f600" * 500, "bytes as UTF-8"),
    ],
)
def test_keys_and_scopes_the_database_cannot_store_are_invalid(
    scope: str, key: str, says: str
) -> None:
    """NUL, lone surrogates, over 512 characters, or too many bytes to index: InvalidKey."""
    with pytest.raises(InvalidKey, match=says):
        check_claimable(scope, key)


def test_ordinary_keys_pass() -> None:
    """Unicode, punctuation and 512 characters are fine."""
    check_claimable("shop.charge/tenant-ä", "k" * MAX_KEY_LENGTH)
    check_claimable("shop.charge", "order:42/ü/\U0001f600")


def test_results_with_nul_keep_their_shape() -> None:
    """A NUL in a result's string becomes U+FFFD; the rest of the value is unchanged."""
    assert json.loads(encode_result({"note": "a\x00b", "n": 1})) == {"note": "a\ufffdb", "n": 1}


def test_results_with_lone_surrogates_and_nan_are_stored_in_a_form_jsonb_takes() -> None:
    """Lone surrogates become U+FFFD (keys too), NaN and infinities become null."""
    value = {"x\ud800": "a\udfffb", "n": float("nan"), "i": float("inf")}
    assert json.loads(encode_result(value)) == {"x\ufffd": "a\ufffdb", "n": None, "i": None}


def test_an_escaped_backslash_before_u0000_is_text_not_a_nul() -> None:
    """The text `\\u0000` (a backslash, then 'u0000') is kept as it is."""
    assert json.loads(encode_result(["\\u0000"])) == ["\\u0000"]
    assert json.loads(storable_json('"\\\\\\u0000"')) == "\\\ufffd"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("x" * (1024 * 1024 + 1), "bytes"),
        (10**20000, "digits"),
    ],
    ids=["over 1 MiB", "20,000 digits"],
)
def test_results_too_large_are_replaced_by_a_marker(value: object, says: str) -> None:
    """Too large or a number numeric cannot hold: a marker saying why, never a failed statement."""
    stored = json.loads(encode_result(value))
    assert says in stored["dedupe_result_dropped"]


def test_results_nested_too_deep_are_replaced_by_a_marker() -> None:
    """Nesting jsonb would refuse (or the encoder cannot reach) becomes a marker."""
    deep: list[object] = []
    for _ in range(3000):
        deep = [deep]
    assert "dedupe_result_dropped" in json.loads(encode_result(deep))
    assert "dedupe_result_dropped" in json.loads(storable_json("[" * 5000 + "]" * 5000))


def test_storable_text_replaces_and_cuts() -> None:
    """Error texts and details lose NUL and surrogates and keep at most `limit` characters."""
    assert storable_text("a\x00b\ud800", 10) == "a\ufffdb\ufffd"
    assert storable_text("abcdef", 3) == "abc"


def test_a_step_result_is_mended_kept_whole_however_large_and_refused_when_not_json() -> None:
    """The step has run: what jsonb can hold is kept (no size or digits policy of a handler's
    result); a value that is not JSON is an error."""
    from dedupe.claims.values import MAX_RESULT_BYTES, step_json

    assert json.loads(step_json({"id": "a\x00b\ud800"})) == {"id": "a\ufffdb\ufffd"}
    assert json.loads(step_json({"a\x00": 1})) == {"a\ufffd": 1}
    assert step_json(None) == "null"
    big = "1" * (MAX_RESULT_BYTES + 1)
    assert json.loads(step_json(big)) == big
    with pytest.raises(ValueError, match="must be JSON"):
        step_json(object())
