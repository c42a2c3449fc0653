"""What the webhook receiver answers: stored replies, replayed byte for byte, and RFC 9457
problem+json (dedupe.asgi.problems) for everything else (its own refusals, Starlette's 404/405,
a bug's 500) as Starlette responses."""

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

from dedupe.asgi.problems import PROBLEM_JSON, Problem
from dedupe.webhooks import Identity, WebhookSource

# Every line the receiver logs comes from one logger, whichever module writes it: operators
# and the tests select the receiver's lines by this name.
logger = logging.getLogger("dedupe_receiver")

REPLAYED_HEADER = "Idempotent-Replayed"
ACCEPTED = 202


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
    """An RFC 9457 problem+json response (an empty detail is left out)."""
    return respond(Problem(status, slug, title, detail or None, extensions=extensions), headers)


def respond(problem: Problem, headers: Mapping[str, str] | None = None) -> Response:
    """`problem` as a Starlette response, with `headers` besides its own."""
    return Response(
        problem.body(),
        problem.status,
        headers={**problem.headers(), **(headers or {})},
        media_type=PROBLEM_JSON,
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
    "REPLAYED_HEADER",
    "ProblemOnError",
    "Reply",
    "accepted",
    "http_problem",
    "problem",
    "respond",
]
