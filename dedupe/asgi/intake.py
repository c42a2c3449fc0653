"""A keyed HTTP request read into the claim it asks for: its body (bounded, read whole to be
fingerprinted), its principal and scope; or the 4xx that says why it cannot have one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection
from dataclasses import dataclass

from dedupe.asgi.keys import (
    PrincipalSource,
    RequestLine,
    request_hashes,
    scope_for,
)
from dedupe.asgi.problems import Problem
from dedupe.asgi.replies import invalid_request, no_principal, too_large
from dedupe.asgi.run import Receive, Scope
from dedupe.claims.fingerprints import Fingerprint
from dedupe.claims.records import ClaimRequest
from dedupe.errors import InvalidPayload

logger = logging.getLogger("dedupe.asgi")


@dataclass(frozen=True, slots=True)
class Keyed:
    """A keyed request ready to claim, with the body the endpoint gets again."""

    request: ClaimRequest
    body: bytes


class _BodyTooLarge(Exception):
    pass


def option_failed(line: RequestLine, exc: Exception) -> Problem:
    """A function of the middleware's options (fingerprint=, key=, scope=) raised on this
    request: a 400 for the client (nothing a client sends yields a 5xx; the endpoint does not
    run), the function's exception logged at WARNING for the API's owner."""
    logger.warning(
        "%s on %s %s: answered 400 invalid-request, the endpoint did not run",
        exc,
        line.method,
        line.path.decode("latin-1"),
        exc_info=exc.__cause__,
        extra={"outcome": "refused"},
    )
    return invalid_request(f"{exc} on this request")


def request_line(scope: Scope) -> RequestLine:
    """Method, raw path and query of the request."""
    return RequestLine(
        scope["method"],
        scope.get("raw_path") or str(scope.get("path", "")).encode("utf-8", "surrogatepass"),
        scope.get("query_string", b""),
    )


async def read_body(scope: Scope, receive: Receive, max_body_bytes: int) -> bytes | Problem | None:
    """The whole body (bounded: a 413 past it), or None: the client left before it arrived."""
    declared = _content_length(scope.get("headers", []))
    if declared is not None and declared > max_body_bytes:
        return too_large(max_body_bytes)
    try:
        return await _read_body(receive, max_body_bytes)
    except _BodyTooLarge:
        return too_large(max_body_bytes)


async def read_keyed(
    scope: Scope,
    receive: Receive,
    *,
    key: str,
    body: bytes | None,
    app_name: str,
    principal_source: PrincipalSource | None,
    secret: bytes | None,
    scheme: Fingerprint,
    max_body_bytes: int,
) -> Keyed | Problem | None:
    """The claim a keyed request asks for, a Problem to answer, or None: the client left.
    `body`: the body when it was read already (to find the key in it)."""
    headers = scope.get("headers", [])
    if body is None:
        read = await read_body(scope, receive, max_body_bytes)
        if read is None or isinstance(read, Problem):
            return read
        body = read
    line = request_line(scope)
    principal = None
    if principal_source is not None:
        principal = principal_source.of(line, headers, body)
        if principal is None:
            return no_principal()
    try:
        payload_hash, raw_hash = request_hashes(scheme, line, headers, body)
    except InvalidPayload as exc:
        # Only the API's fingerprint= function raises it (or returns no bytes).
        return option_failed(line, exc)
    request = ClaimRequest(
        scope_for(app_name, principal, secret), key, payload_hash, scheme.stored, raw_hash
    )
    return Keyed(request, body)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body; None when the client went away first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _content_length(headers: Collection[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


__all__ = ["Keyed", "option_failed", "read_body", "read_keyed", "request_line"]
