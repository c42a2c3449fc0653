"""What "the same payload" means for conflict detection, per handler and webhook source.

A fingerprint is compiled once, at registration: `"raw"` (the body bytes, the default),
`"json"` (the body's JSON value: key order, insignificant whitespace and the spelling of
numbers do not matter; `exclude` paths are left out) or the user's `(Message) -> bytes`. A
claim request carries the SHA-256 of the payload under its scheme, the scheme's name (stored
with the claim, so that changing a handler's fingerprint does not turn the keys stored under
the old one into conflicts: dedupe/sql/queries.sql, claim_batch) and the raw hash beside it.

Decisions (docs/design.md, section 3):
- Numbers are compared by value: JSON has one number type (RFC 8259), so 1, 1.0 and 1e0 are
  the same number, compared exactly (no float rounding); -0 is 0.
- Strings are compared as parsed (an escaped and a literal character are the same), never
  normalised further: "é" composed and decomposed are different data.
- A body that is not JSON (or nested deeper than MAX_DEPTH) is fingerprinted by its bytes, as
  under "raw": the claim goes ahead and the handler's decoding decides (an invalid payload
  fails its key once and its redeliveries are duplicates of that failure).
- An excluded path names object members by their names, array elements by their position or
  every member with `*`; an excluded array element counts as null (positions stay put).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dedupe.claims.records import ClaimRequest
from dedupe.errors import ConfigurationError, InvalidPayload
from dedupe.message import Message

FingerprintFunc = Callable[[Message], bytes]
FingerprintSpec = str | FingerprintFunc

# A kept payload is for operators comparing two payloads, not a blob store.
KEEP_PAYLOAD_MAX_BYTES = 64 * 1024
# Bodies nested deeper are fingerprinted by their bytes: one answer for one body, whatever the
# stack depth of the code that asks (a worker's and a receiver's differ).
MAX_DEPTH = 256
MAX_EXCLUDE_PATHS = 32
# The scheme's name is stored with every claim of the handler: keep it short.
MAX_SCHEME_CHARS = 500

WILDCARD = "*"


class NotJSON(Exception):
    """The body is no JSON value this module compares (internal)."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A compiled fingerprint: its scheme's name and how it digests a message."""

    scheme: str
    exclude: tuple[tuple[str, ...], ...] = ()
    func: FingerprintFunc | None = field(default=None, repr=False, compare=False)

    @property
    def stored(self) -> str | None:
        """The scheme as the claims table stores it (NULL for raw: every older claim is raw)."""
        return None if self.scheme == "raw" else self.scheme

    @property
    def is_json(self) -> bool:
        return self.scheme == "json" or self.scheme.startswith("json ")

    def digest(self, message: Message) -> bytes:
        """SHA-256 of the payload under this scheme; InvalidPayload when a callable fails."""
        if self.func is not None:
            try:
                value = self.func(message)
            except Exception as exc:
                raise InvalidPayload(
                    f"the fingerprint function raised {exc.__class__.__name__}"
                ) from exc
            if not isinstance(value, bytes | bytearray | memoryview):
                raise InvalidPayload(
                    f"the fingerprint function returned {type(value).__name__}, not bytes"
                )
            return hashlib.sha256(value).digest()
        if self.is_json:
            try:
                return hashlib.sha256(canonical(self.view(message.body)).encode()).digest()
            except NotJSON:
                pass
        return hashlib.sha256(message.body).digest()

    def view(self, body: bytes) -> Any:
        """The body's JSON value with the excluded paths left out; NotJSON when it has none."""
        value = parse(body)
        for path in self.exclude:
            _leave_out(value, path)
        return value


RAW = Fingerprint("raw")


def parse(body: bytes) -> Any:
    """The body's JSON value, numbers as Decimal (exact); NotJSON when it is not JSON."""
    try:
        return json.loads(body, parse_float=Decimal, parse_int=Decimal, parse_constant=_refuse)
    except (ValueError, RecursionError, TypeError) as exc:
        # UnicodeDecodeError is a ValueError; NaN and Infinity are not JSON (RFC 8259).
        raise NotJSON(str(exc)) from exc


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def canonical(value: Any) -> str:
    """One text per JSON value: sorted members, no whitespace, numbers by value (ASCII)."""
    out: list[str] = []
    _encode(value, out, 0)
    return "".join(out)


def _encode(value: Any, out: list[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise NotJSON(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        out.append("{")
        for i, name in enumerate(sorted(value)):
            if i:
                out.append(",")
            out.append(json.dumps(name))
            out.append(":")
            _encode(value[name], out, depth + 1)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, out, depth + 1)
        out.append("]")
    elif isinstance(value, str):
        out.append(json.dumps(value))  # ASCII: lone surrogates are escaped, not refused
    elif isinstance(value, Decimal):
        out.append(number(value))
    else:
        out.append(json.dumps(value))  # true, false, null


def number(value: Decimal) -> str:
    """A number's canonical spelling: its significant digits and exponent, e.g. 1.50 -> 15e-1.

    Exact for any size (Decimal.normalize would round to the context's 28 digits)."""
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # JSON has no NaN or infinity
    kept = list(digits)
    while len(kept) > 1 and kept[-1] == 0:
        kept.pop()
        exponent += 1
    if kept == [0]:
        return "0"
    return f"{'-' if sign else ''}{''.join(map(str, kept))}e{exponent}"


def _leave_out(node: Any, path: tuple[str, ...]) -> None:
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        names = list(node) if head == WILDCARD else [head] if head in node else []
        for name in names:
            if rest:
                _leave_out(node[name], rest)
            else:
                del node[name]
    elif isinstance(node, list):
        if head == WILDCARD:
            places: Iterable[int] = range(len(node))
        elif head.isascii() and head.isdigit() and int(head) < len(node):
            places = [int(head)]
        else:
            places = []
        for i in places:
            if rest:
                _leave_out(node[i], rest)
            else:
                node[i] = None


# -- registration ----------------------------------------------------------------------------


def compile_fingerprint(
    spec: FingerprintSpec = "raw", *, exclude: Iterable[str] = (), where: str = "fingerprint"
) -> Fingerprint:
    """Check a fingerprint spec and its exclude paths; ConfigurationError says what to write."""
    if isinstance(exclude, str):
        raise ConfigurationError(
            f"{where}: fingerprint_exclude takes a tuple: fingerprint_exclude=({exclude!r},)"
        )
    paths = list(exclude)
    if callable(spec):
        if paths:
            raise _exclude_needs_json(where)
        name = getattr(spec, "__qualname__", None) or type(spec).__qualname__
        scheme = f"callable {getattr(spec, '__module__', None) or '?'}:{name}"
        return Fingerprint(scheme[:MAX_SCHEME_CHARS], func=spec)
    if spec == "raw":
        if paths:
            raise _exclude_needs_json(where)
        return RAW
    if spec != "json":
        raise ConfigurationError(
            f"{where}: fingerprint={spec!r}: use 'raw' (the body bytes), 'json' (the JSON value: "
            "key order and whitespace do not matter) or a callable (Message) -> bytes"
        )
    if not paths:
        return Fingerprint("json")
    if len(paths) > MAX_EXCLUDE_PATHS:
        raise ConfigurationError(
            f"{where}: fingerprint_exclude lists {len(paths)} paths; at most {MAX_EXCLUDE_PATHS}"
        )
    parsed = sorted({_check_path(path, where) for path in paths})
    scheme = "json exclude=" + json.dumps([".".join(p) for p in parsed], separators=(",", ":"))
    if len(scheme) > MAX_SCHEME_CHARS:
        raise ConfigurationError(
            f"{where}: fingerprint_exclude is too long: the scheme stored with every claim "
            f"({len(scheme)} characters) must fit {MAX_SCHEME_CHARS} characters"
        )
    return Fingerprint(scheme, exclude=tuple(parsed))


def _exclude_needs_json(where: str) -> ConfigurationError:
    return ConfigurationError(
        f"{where}: fingerprint_exclude needs fingerprint='json' (raw bytes have no paths to "
        "leave out; a fingerprint function leaves out what it likes)"
    )


def _check_path(path: object, where: str) -> tuple[str, ...]:
    if not isinstance(path, str):
        raise ConfigurationError(
            f"{where}: fingerprint_exclude takes strings (dotted body paths like 'meta.trace'), "
            f"not {type(path).__name__}"
        )
    if path != path.strip():
        raise ConfigurationError(f"{where}: fingerprint_exclude path {path!r} has spaces around it")
    parts = tuple(path.split("."))
    if any(not part for part in parts):
        raise ConfigurationError(
            f"{where}: fingerprint_exclude path {path!r} has an empty segment; write dotted body "
            "paths like 'meta.trace' or 'items.*.sent_at'"
        )
    if all(part == WILDCARD for part in parts):
        raise ConfigurationError(
            f"{where}: fingerprint_exclude path {path!r} would leave out the whole body"
        )
    return parts


# -- the claim a message asks for ------------------------------------------------------------


def claim_request(
    scope: str,
    key: str,
    message: Message,
    fingerprint: Fingerprint,
    *,
    keep_payload: bool = False,
) -> ClaimRequest:
    """The claim for (scope, key) with the message's fingerprint; InvalidPayload when a
    fingerprint function fails. The body rides along when kept and at most 64 KiB."""
    payload_hash = fingerprint.digest(message)
    raw_hash = None if fingerprint.stored is None else hashlib.sha256(message.body).digest()
    kept = message.body if keep_payload and len(message.body) <= KEEP_PAYLOAD_MAX_BYTES else None
    return ClaimRequest(scope, key, payload_hash, fingerprint.stored, raw_hash, kept)


__all__ = [
    "KEEP_PAYLOAD_MAX_BYTES",
    "RAW",
    "Fingerprint",
    "FingerprintFunc",
    "FingerprintSpec",
    "NotJSON",
    "canonical",
    "claim_request",
    "compile_fingerprint",
    "number",
    "parse",
]
