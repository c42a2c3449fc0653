"""Log formats: readable text by default, one JSON object per line on request."""

from __future__ import annotations

import io
import json
import logging

import pytest

from dedupe.observability import logs


def emit(fmt: str, **extra: object) -> str:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    logs.configure("DEBUG", fmt, stream=stream)
    try:
        logging.getLogger("dedupe.test").warning("attempt %d failed", 2, extra=extra)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return stream.getvalue()


def test_json_lines_carry_the_message_fields() -> None:
    """Every JSON line has time, level, logger, message and the message's fields."""
    line = emit(
        "json", scope="shop.charge", key="k-1", message_id="m-1", attempt=2, outcome="retried"
    )
    document = json.loads(line)
    assert document["level"] == "WARNING"
    assert document["logger"] == "dedupe.test"
    assert document["message"] == "attempt 2 failed"
    assert {k: document[k] for k in ("scope", "key", "message_id", "attempt", "outcome")} == {
        "scope": "shop.charge",
        "key": "k-1",
        "message_id": "m-1",
        "attempt": 2,
        "outcome": "retried",
    }


def test_text_lines_append_the_message_fields() -> None:
    """A human-readable line ends with the fields in brackets."""
    line = emit("text", scope="shop.charge", key="k-1", attempt=2)
    assert line.rstrip().endswith("attempt 2 failed  [scope=shop.charge key=k-1 attempt=2]")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_extras_outside_the_message_fields_are_never_printed(fmt: str) -> None:
    """A payload or a header handed to extra= by mistake does not reach the output."""
    line = emit(fmt, key="k-1", body="card=4242424242424242", signature="v1,c2VjcmV0")
    assert "4242" not in line
    assert "c2VjcmV0" not in line
    assert "k-1" in line


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        logs.configure("INFO", "xml")
