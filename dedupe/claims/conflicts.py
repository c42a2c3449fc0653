"""A conflict people can act on: both fingerprints and, when both payloads are known, the
paths that differ, with their values redacted as the logs redact payloads (never shown: a
path and the JSON types on each side are all a diff says). No I/O.

The report travels on the conflict's Settlement: its headers go on the dead letter
(dedupe.transport.dead_letter_headers); its record (the second payload kept for
`dedupe-worker conflicts settle`) and its event are written before the message is settled, by
dedupe.claims.conflict_records.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dedupe.claims.fingerprints import MAX_DEPTH, Fingerprint, NotJSON, parse
from dedupe.claims.records import ClaimRequest
from dedupe.claims.values import storable_text
from dedupe.message import Message

FINGERPRINT_HEADER = "x-dedupe-fingerprint"  # the dead-lettered message's
CLAIMED_FINGERPRINT_HEADER = "x-dedupe-claimed-fingerprint"  # the claim's, made first
DIFF_HEADER = "x-dedupe-diff"
CONFLICT_HEADERS = (FINGERPRINT_HEADER, CLAIMED_FINGERPRINT_HEADER, DIFF_HEADER)
# A conflict settled with `--run-as NEW_KEY` republishes the second payload with these: under
# the handler whose scope is RUN_AS_SCOPE_HEADER the key is RUN_AS_HEADER, whatever its key
# spec says (dedupe.claims.verdicts.request_for); the channel's other handlers key it as before.
RUN_AS_HEADER = "x-dedupe-run-as"
RUN_AS_SCOPE_HEADER = "x-dedupe-run-as-scope"

MAX_CHANGES = 20
MAX_DIFF_HEADER_CHARS = 1000
MAX_EVENT_CHARS = 300
MAX_SEGMENT_CHARS = 64
_PLAIN_SEGMENT = re.compile(r"[A-Za-z0-9_\-]+")
WHOLE_BODY = "(the whole body)"


def fingerprint_text(scheme: str | None, digest: bytes | None) -> str:
    """A fingerprint as operators read it: the scheme, then the SHA-256 in hex."""
    return f"{scheme or 'raw'} {digest.hex() if digest is not None else '?'}"


def _short(text: str) -> str:
    """The scheme and the first 12 hex digits, for one-line summaries."""
    scheme, _, digest = text.rpartition(" ")
    return f"{scheme} {digest[:12]}"


@dataclass(frozen=True, slots=True)
class ConflictReport:
    """A message refused because its key was first claimed with another payload."""

    scope: str
    key: str
    fingerprint: str  # the message's: scheme and hash
    claimed: str  # the claim's
    payload_hash: bytes  # the message's hash under its scheme (the record's identity)
    changes: tuple[str, ...] | None  # the paths that differ; None when they cannot be known
    more: int = 0  # changes beyond MAX_CHANGES
    note: str | None = None  # why there is no diff, or what an empty one means
    channel: str = ""
    message_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str | None = None
    payload: bytes | None = field(default=None, repr=False)  # the second payload, when kept
    source: str | None = None  # the webhook source that refused it (None: a handler)
    http_request: str | None = None  # the HTTP middleware's 422: 'POST /orders' (no query)

    def diff_text(self) -> str:
        """The changes on one line, or the note when there are none."""
        if not self.changes:
            return self.note or ""
        text = "; ".join(self.changes)
        return text + (f"; and {self.more} more" if self.more else "")

    def dead_letter_headers(self) -> dict[str, str]:
        return {
            FINGERPRINT_HEADER: self.fingerprint,
            CLAIMED_FINGERPRINT_HEADER: self.claimed,
            DIFF_HEADER: storable_text(self.diff_text(), MAX_DIFF_HEADER_CHARS),
        }

    def event_detail(self) -> str:
        """The history event's detail: both fingerprints (short) and what differs."""
        text = (
            f"another payload: {_short(self.fingerprint)}, the claim's {_short(self.claimed)}"
            f"; {self.diff_text() or 'no diff'}"
        )
        if len(text) > MAX_EVENT_CHARS:
            text = text[: MAX_EVENT_CHARS - 1] + "\u2026"
        return storable_text(text)


def report(
    request: ClaimRequest,
    message: Message,
    fingerprint: Fingerprint,
    *,
    claimed_fingerprint: str | None,
    claimed_hash: bytes | None,
    claimed_payload: bytes | None,
    keep_payload: bool,
    source: str | None = None,
) -> ConflictReport:
    """The report of `message` (claim `request`) refused by a claim made for another payload."""
    changes: tuple[str, ...] | None = None
    more = 0
    note: str | None = None
    if claimed_payload is None:
        note = "the claim kept no payload (keep_payload=False, or over 64 KiB): no diff"
    else:
        view = fingerprint.view if fingerprint.is_json else parse
        try:
            first, second = view(claimed_payload), view(message.body)
        except NotJSON:
            note = (
                f"the payloads are not both JSON ({len(claimed_payload)} and "
                f"{len(message.body)} bytes): no diff"
            )
        else:
            found, more = json_diff(first, second)
            changes = tuple(found)
            if not changes:
                note = _same_value_note(fingerprint, claimed_fingerprint)
    return ConflictReport(
        scope=request.scope,
        key=request.key,
        fingerprint=fingerprint_text(request.fingerprint, request.payload_hash),
        claimed=fingerprint_text(claimed_fingerprint, claimed_hash),
        payload_hash=request.payload_hash,
        changes=changes,
        more=more,
        note=note,
        channel=message.channel,
        message_id=message.message_id,
        headers=dict(message.headers),
        content_type=message.content_type,
        payload=request.payload if keep_payload else None,
        source=source,
    )


HTTP_NOTE = (
    "another request under this key (method, path, query or body differ); the middleware "
    "keeps no body: no diff"
)


def http_report(
    request: ClaimRequest,
    *,
    method: str,
    path: str,
    claimed_fingerprint: str | None,
    claimed_hash: bytes | None,
) -> ConflictReport:
    """The report of an HTTP request refused with a 422 by the idempotency middleware: both
    fingerprints and the request's method and path (never its query, headers or body)."""
    return ConflictReport(
        scope=request.scope,
        key=request.key,
        fingerprint=fingerprint_text(request.fingerprint, request.payload_hash),
        claimed=fingerprint_text(claimed_fingerprint, claimed_hash),
        payload_hash=request.payload_hash,
        changes=None,
        note=HTTP_NOTE,
        http_request=storable_text(f"{method} {path}", 1000),
    )


def _same_value_note(fingerprint: Fingerprint, claimed_fingerprint: str | None) -> str:
    if fingerprint.stored is None:
        return (
            "the same JSON value: only key order, whitespace or the spelling of numbers "
            "differ; fingerprint='json' takes such a retry as the same payload"
        )
    if fingerprint.func is not None:
        return "the same JSON value; the fingerprint function tells them apart"
    return (
        f"no path differs under {fingerprint.scheme}; the claim was made under "
        f"{claimed_fingerprint or 'raw'}"
    )


# -- the diff --------------------------------------------------------------------------------


def kind(value: Any) -> str:
    """A JSON value's type: all a diff tells about a value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float | Decimal):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def json_diff(first: Any, second: Any) -> tuple[list[str], int]:
    """The paths at which two JSON values differ, as `~ path (type)`, `+ path (type)` or
    `- path (type)`, in path order; at most MAX_CHANGES, and how many more."""
    changes: list[str] = []
    more = 0

    def note(sign: str, path: tuple[str, ...], kinds: str) -> None:
        nonlocal more
        if len(changes) < MAX_CHANGES:
            changes.append(f"{sign} {render(path)} ({kinds})")
        else:
            more += 1

    def walk(a: Any, b: Any, path: tuple[str, ...]) -> None:
        kind_a, kind_b = kind(a), kind(b)
        if kind_a != kind_b:
            note("~", path, f"{kind_a} -> {kind_b}")
        elif len(path) > MAX_DEPTH:
            if a != b:
                note("~", path, kind_a)
        elif kind_a == "object":
            for name in sorted(set(a) | set(b)):
                if name not in b:
                    note("-", (*path, name), kind(a[name]))
                elif name not in a:
                    note("+", (*path, name), kind(b[name]))
                else:
                    walk(a[name], b[name], (*path, name))
        elif kind_a == "array":
            for i in range(max(len(a), len(b))):
                if i >= len(b):
                    note("-", (*path, str(i)), kind(a[i]))
                elif i >= len(a):
                    note("+", (*path, str(i)), kind(b[i]))
                else:
                    walk(a[i], b[i], (*path, str(i)))
        elif a != b:
            note("~", path, kind_a)

    walk(first, second, ())
    return changes, more


def render(path: tuple[str, ...]) -> str:
    """A dotted path, as fingerprint_exclude takes it; other names quoted, long ones cut."""
    if not path:
        return WHOLE_BODY
    parts = []
    for segment in path:
        if len(segment) > MAX_SEGMENT_CHARS:
            segment = segment[: MAX_SEGMENT_CHARS - 1] + "\u2026"
        plain = _PLAIN_SEGMENT.fullmatch(segment) is not None
        parts.append(segment if plain else '"' + segment.replace('"', '\\"') + '"')
    return storable_text(".".join(parts))


__all__ = [
    "CLAIMED_FINGERPRINT_HEADER",
    "CONFLICT_HEADERS",
    "DIFF_HEADER",
    "FINGERPRINT_HEADER",
    "MAX_CHANGES",
    "RUN_AS_HEADER",
    "RUN_AS_SCOPE_HEADER",
    "ConflictReport",
    "fingerprint_text",
    "http_report",
    "json_diff",
    "kind",
    "render",
    "report",
]
