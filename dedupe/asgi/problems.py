"""RFC 9457 problem+json, one definition for the idempotency middleware and the webhook
receiver: the document, its headers, and the answers both give (a key in flight: 409; the
store or the broker unavailable: 503). Plain ASGI; the receiver wraps them in its framework's
response."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

ASGIMessage = MutableMapping[str, Any]
Send = Callable[[ASGIMessage], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

PROBLEM_JSON = "application/problem+json"
# A key in flight is held for one publish (the receiver) or one endpoint's run (the
# middleware): come back in a second.
IN_FLIGHT_RETRY_AFTER_S = 1
# The database or the broker is unreachable: give it a moment.
UNAVAILABLE_RETRY_AFTER_S = 5


async def send_response(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """One whole response, with its Content-Length."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


@dataclass(frozen=True, slots=True)
class Problem:
    """An RFC 9457 problem+json answer, of type `urn:dedupe-worker:problem:<slug>`."""

    status: int
    slug: str
    title: str
    detail: str | None = None
    retry_after_s: int | None = None
    close: bool = False  # Connection: close (a body left unread)
    extensions: Mapping[str, Any] = field(default_factory=dict)

    def body(self) -> bytes:
        """The JSON document: type, title, status, detail (when there is one), extensions."""
        document: dict[str, Any] = {
            "type": f"urn:dedupe-worker:problem:{self.slug}",
            "title": self.title,
            "status": self.status,
        }
        if self.detail is not None:
            document["detail"] = self.detail
        document.update(self.extensions)
        return json.dumps(document, separators=(",", ":")).encode()

    def headers(self) -> dict[str, str]:
        """Its headers besides Content-Type and Content-Length: Retry-After, Connection."""
        headers = {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(self.retry_after_s)
        if self.close:
            headers["connection"] = "close"
        return headers

    async def send(self, send: Send) -> None:
        headers: Headers = [(b"content-type", PROBLEM_JSON.encode())]
        headers.extend((name.encode(), value.encode()) for name, value in self.headers().items())
        await send_response(send, self.status, headers, self.body())


def in_flight(detail: str | None = None) -> Problem:
    """409: another request under this key is being processed; retry shortly."""
    return Problem(
        409,
        "in-flight",
        "Request in flight",
        detail or "a request with this idempotency key is being processed; retry shortly",
        IN_FLIGHT_RETRY_AFTER_S,
    )


def unavailable(detail: str, *, slug: str = "store-unavailable") -> Problem:
    """503: what is needed to answer (the claims' database, the broker) is unreachable."""
    return Problem(503, slug, "Service unavailable", detail, UNAVAILABLE_RETRY_AFTER_S)


__all__ = [
    "IN_FLIGHT_RETRY_AFTER_S",
    "PROBLEM_JSON",
    "UNAVAILABLE_RETRY_AFTER_S",
    "ASGIMessage",
    "Headers",
    "Problem",
    "Send",
    "in_flight",
    "send_response",
    "unavailable",
]
