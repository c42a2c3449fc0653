"""What an HTTP request's claim is made of, with no I/O: its Idempotency-Key, its principal
(hashed), its fingerprint and the scope its key lives in."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from dedupe.claims.keys import KeyFunc
from dedupe.errors import InvalidPayload, KeyMissing
from dedupe.message import Headers, Message

KEY_HEADER = b"idempotency-key"
MAX_KEY_CHARS = 255
# The part of a scope after the app's name: `shop.http`, then `/<principal hash>`.
SCOPE_SUFFIX = ".http"

RawHeaders = Iterable[tuple[bytes, bytes]]


class KeyRefused(ValueError):
    """The request's Idempotency-Key header cannot be a key (the message says why): a 400."""


@dataclass(frozen=True, slots=True)
class RequestLine:
    """What the fingerprint covers besides the body."""

    method: str
    path: bytes
    query: bytes


def _unquote(raw: bytes) -> bytes:
    """An RFC 8941 sf-string's content: `"..."` with `\\"` and `\\\\` escapes."""
    if len(raw) < 2 or not raw.endswith(b'"'):
        raise KeyRefused('a quoted Idempotency-Key must end with its closing quote (")')
    out = bytearray()
    escaped = False
    for byte in raw[1:-1]:
        if escaped:
            if byte not in b'"\\':
                raise KeyRefused('in a quoted Idempotency-Key only \\" and \\\\ are escapes')
            out.append(byte)
            escaped = False
        elif byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x22:  # a bare quote inside the string
            raise KeyRefused('a quoted Idempotency-Key has an unescaped quote (")')
        else:
            out.append(byte)
    if escaped:
        raise KeyRefused("a quoted Idempotency-Key ends in a lone backslash")
    return bytes(out)


def key_of(headers: RawHeaders) -> str | None:
    """The request's idempotency key; None without the header; KeyRefused when it is not one.

    One header of 1-255 visible ASCII characters (%x21-7E). A value that starts with a quote is
    read as a structured-field string, as the IETF draft writes the key, and its content must be
    visible ASCII too (so `"abc"` and `abc` are the same key).
    """
    values = [value for name, value in headers if name.lower() == KEY_HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise KeyRefused(f"send one Idempotency-Key header, not {len(values)}")
    raw = values[0].strip(b" \t")
    if raw.startswith(b'"'):
        raw = _unquote(raw)
    if not raw:
        raise KeyRefused("the Idempotency-Key header is empty")
    if len(raw) > MAX_KEY_CHARS:
        raise KeyRefused(
            f"the Idempotency-Key is {len(raw)} characters long; at most {MAX_KEY_CHARS}"
        )
    if any(byte < 0x21 or byte > 0x7E for byte in raw):
        raise KeyRefused("an Idempotency-Key is visible ASCII only (no spaces, no controls)")
    return raw.decode("ascii")


def fingerprint(line: RequestLine, body: bytes) -> bytes:
    """SHA-256 of method, path, query and body, each length-prefixed (no two requests share
    an encoding)."""
    digest = hashlib.sha256()
    for part in (line.method.encode("ascii", "replace"), line.path, line.query, body):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def principal_hash(principal: str) -> str:
    """The principal as stored: the hex SHA-256 of its UTF-8 text, never the text itself."""
    return hashlib.sha256(principal.encode("utf-8", "surrogatepass")).hexdigest()


def scope_for(app_name: str, principal: str | None) -> str:
    """The claims' scope of a request: `<app>.http`, plus `/<principal hash>` when scoped."""
    base = app_name + SCOPE_SUFFIX
    return base if principal is None else f"{base}/{principal_hash(principal)}"


def request_message(line: RequestLine, headers: RawHeaders, body: bytes) -> Message:
    """The request as a dedupe.Message, for a scope= key spec or callable to read."""
    return Message(
        channel=line.path.decode("latin-1"),
        body=body,
        # latin-1 maps every byte to one character: a header's bytes survive as its text.
        headers=Headers(
            {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
        ),
        meta={"method": line.method, "path": line.path.decode("latin-1"), "query": line.query},
    )


def principal_of(scope_func: KeyFunc, message: Message) -> str | None:
    """Whose request this is, by the middleware's scope=; None when it names nobody."""
    try:
        value = scope_func(message)
    except (InvalidPayload, KeyMissing):
        # A body path on a body that is not JSON: the request names no principal.
        return None
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else str(value)


__all__ = [
    "KEY_HEADER",
    "MAX_KEY_CHARS",
    "SCOPE_SUFFIX",
    "KeyRefused",
    "RequestLine",
    "fingerprint",
    "key_of",
    "principal_hash",
    "principal_of",
    "request_message",
    "scope_for",
]
