"""What the webhook receiver answers: stored replies, replayed byte for byte, and RFC 9457
problem+json for everything else (its own refusals, Starlette's 404/405, a bug's 500)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dedupe.webhooks import Identity, WebhookSource

# Every line the receiver logs comes from one logger, whichever module writes it: operators
# and the tests select the receiver's lines by this name.
logger = logging.getLogger("dedupe_receiver")

PROBLEM_JSON = "application/problem+json"
REPLAYED_HEADER = "Idempotent-Replayed"
ACCEPTED = 202
# A key in flight is held for milliseconds (one publish); come back soon.
IN_FLIGHT_RETRY_AFTER_S = 1
# The broker or the database is down: give it a moment.
UNAVAILABLE_RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class Reply:
    """A response as stored in the claim's result and replayed byte for byte."""

    status: int
    body: str
    content_type: str = "application/json"

    def to_result(self) -> str:
        return json.dumps(
            {"status": self.status, "content_type": self.content_type, "body": self.body}
        )

    @classmethod
    def from_result(cls, result: str | None) -> Reply | None:
        try:
            stored = json.loads(result or "null")
            return cls(int(stored["status"]), str(stored["body"]), str(stored["content_type"]))
        except (ValueError, TypeError, KeyError):
            return None

    def response(self, *, replayed: bool = False) -> Response:
        headers = {REPLAYED_HEADER: "true"} if replayed else None
        return Response(self.body, self.status, headers=headers, media_type=self.content_type)


def accepted(source: WebhookSource, identity: Identity) -> Reply:
    """The reply to a published request: a pure function of the key, so every replay and
    every take-over after a crash answers with the same bytes."""
    body = {
        "status": "accepted",
        "source": source.name,
        "key": identity.key,
        "message_id": identity.message_id,
    }
    return Reply(ACCEPTED, json.dumps(body, separators=(",", ":")))


def problem(
    status: int,
    slug: str,
    title: str,
    detail: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    **extensions: Any,
) -> Response:
    """An RFC 9457 problem+json response."""
    document: dict[str, Any] = {
        "type": f"urn:dedupe-worker:problem:{slug}",
        "title": title,
        "status": status,
    }
    if detail:
        document["detail"] = detail
    document.update(extensions)
    return Response(
        json.dumps(document, separators=(",", ":")),
        status,
        headers=dict(headers or {}),
        media_type=PROBLEM_JSON,
    )


def in_flight() -> Response:
    return problem(
        409,
        "in-flight",
        "Request in flight",
        "a request with this idempotency key is being processed; retry shortly",
        headers={"Retry-After": str(IN_FLIGHT_RETRY_AFTER_S)},
    )


def unavailable(slug: str, detail: str) -> Response:
    return problem(
        503,
        slug,
        "Service unavailable",
        detail,
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


async def http_problem(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 as problem+json."""
    assert isinstance(exc, HTTPException)
    return problem(
        exc.status_code,
        "http-error",
        str(exc.detail),
        headers=exc.headers,
    )


class ProblemOnError:
    """A bug of ours is a logged 500 problem+json, not Starlette's text/plain 500 (and it is
    not raised on to the server, which would log it a second time)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            logger.exception(
                "unexpected error answering %s %s: 500",
                scope.get("method"),
                scope.get("path"),
                extra={"outcome": "internal_error"},
            )
            if started:
                raise  # too late for a reply of ours: let the server close the connection
            response = problem(
                500,
                "internal-error",
                "Internal server error",
                "an unexpected error in the receiver; it has been logged",
            )
            await response(scope, receive, send)


__all__ = [
    "ACCEPTED",
    "IN_FLIGHT_RETRY_AFTER_S",
    "PROBLEM_JSON",
    "REPLAYED_HEADER",
    "UNAVAILABLE_RETRY_AFTER_S",
    "ProblemOnError",
    "Reply",
    "accepted",
    "http_problem",
    "in_flight",
    "problem",
    "unavailable",
]
