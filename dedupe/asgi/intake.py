"""A keyed HTTP request read into the claim it asks for: its body (bounded, read whole to be
fingerprinted), its principal and scope; or the 4xx that says why it cannot have one."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from dataclasses import dataclass

from dedupe.asgi.keys import RequestLine, fingerprint, principal_of, request_message, scope_for
from dedupe.asgi.problems import Problem
from dedupe.asgi.replies import no_principal, too_large
from dedupe.asgi.run import Receive, Scope
from dedupe.claims.keys import KeyFunc
from dedupe.claims.records import ClaimRequest


@dataclass(frozen=True, slots=True)
class Keyed:
    """A keyed request ready to claim, with the body the endpoint gets again."""

    request: ClaimRequest
    body: bytes


class _BodyTooLarge(Exception):
    pass


async def read_keyed(
    scope: Scope,
    receive: Receive,
    *,
    key: str,
    app_name: str,
    scope_func: KeyFunc | None,
    max_body_bytes: int,
) -> Keyed | Problem | None:
    """The claim a keyed request asks for, a Problem to answer, or None: the client left."""
    headers = scope.get("headers", [])
    declared = _content_length(headers)
    if declared is not None and declared > max_body_bytes:
        return too_large(max_body_bytes)
    try:
        body = await _read_body(receive, max_body_bytes)
    except _BodyTooLarge:
        return too_large(max_body_bytes)
    if body is None:
        return None
    line = RequestLine(
        scope["method"],
        scope.get("raw_path") or str(scope.get("path", "")).encode("utf-8", "surrogatepass"),
        scope.get("query_string", b""),
    )
    principal = None
    if scope_func is not None:
        principal = principal_of(scope_func, request_message(line, headers, body))
        if principal is None:
            return no_principal()
    return Keyed(ClaimRequest(scope_for(app_name, principal), key, fingerprint(line, body)), body)


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


__all__ = ["Keyed", "read_keyed"]
