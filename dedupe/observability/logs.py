"""Log output: human-readable lines by default, one JSON object per line for machines.

Lines about a message carry its fields (scope, key, message_id, attempt, outcome ...) as
`extra=`; both formats print those fields and nothing else from `extra`, so a value that
was never meant for the logs (a payload, a header, a secret) cannot leak through them.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

# The only `extra=` fields a line may carry, in the order they are printed.
FIELDS = (
    "handler",
    "scope",
    "key",
    "message_id",
    "attempt",
    "outcome",
    "reason",
    "trace_id",
    "source",
    "channel",
)
FORMATS = ("text", "json")
# Broker clients log whole frames, bodies included, at DEBUG: never a payload in the logs.
NOISY = ("aiormq", "aio_pika", "aiokafka")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The message fields a record carries, without the unset ones."""
    return {name: value for name in FIELDS if (value := getattr(record, name, None)) is not None}


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message  scope=... key=...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = fields_of(record)
        if not fields:
            return line
        suffix = " ".join(f"{name}={value}" for name, value in fields.items())
        head, sep, tail = line.partition("\n")  # a traceback goes after the fields
        return f"{head}  [{suffix}]{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the message fields, error."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **fields_of(record),
        }
        if record.exc_info:
            document["error"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str, separators=(",", ":"))


def configure(level: str = "INFO", fmt: str = "text", *, stream: TextIO | None = None) -> None:
    """Send every log line to stderr (or `stream`) in the chosen format."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))


__all__ = ["FIELDS", "JsonFormatter", "TextFormatter", "configure", "fields_of"]
