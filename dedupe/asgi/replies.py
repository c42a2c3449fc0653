"""What the idempotency middleware answers itself: responses stored as a claim's result and
replayed byte for byte, and its own refusals as RFC 9457 problems (dedupe.asgi.problems)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from dedupe.asgi.problems import Problem, Send, in_flight, send_response, unavailable
from dedupe.claims.records import ClaimRequest
from dedupe.claims.verdicts import Conflict, Duplicate, InFlight, Unavailable, Verdict
from dedupe.errors import ConfigurationError
from dedupe.observability.activity import Activity

logger = logging.getLogger("dedupe.asgi")

REPLAYED_HEADER = b"idempotent-replayed"
# Headers kept with a stored response and replayed: what the body means, where the created
# resource is and when to come back. Never Set-Cookie or anything else a later caller must not
# get.
KEPT_HEADERS = frozenset(
    {
        b"content-type",
        b"content-encoding",
        b"content-language",
        b"content-location",
        b"location",
        b"retry-after",
    }
)
# Kept with a response whose body is not (too large, streamed): no body for the others to describe.
KEPT_WITHOUT_BODY = frozenset({b"location", b"retry-after"})
RECORD_VERSION = 1
# Answers below 500 that are never stored (Stripe's rule: they say nothing the endpoint decided
# about the request; a retry must run it again): unauthenticated, forbidden, a request timeout,
# a conflict, too early, rate limited. Every 5xx is never stored either, whatever store_status=.
NOT_STORED = frozenset({401, 403, 408, 409, 425, 429})

StoreStatus = Callable[[int], bool] | Collection[int]


def compile_store_status(spec: StoreStatus | None) -> Callable[[int], bool]:
    """The middleware's store_status=: whether an answer below 500 is stored. None: all but
    NOT_STORED; a collection: the statuses never stored (in place of NOT_STORED); a callable
    (status) -> bool: True stores."""
    if spec is None:
        return lambda status: status not in NOT_STORED
    if callable(spec):
        return spec
    if isinstance(spec, str | bytes) or not isinstance(spec, Collection):
        raise ConfigurationError(
            "IdempotencyMiddleware: store_status= is a set of statuses never stored, such as "
            "{401, 403, 429}, or a callable (status: int) -> bool that is True to store"
        )
    statuses = frozenset(spec)
    for status in statuses:
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise ConfigurationError(
                f"IdempotencyMiddleware: store_status= holds {status!r}, not an HTTP status "
                "(an int from 100 to 599)"
            )
    return lambda status: status not in statuses


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as kept in the claims table: status, the kept headers and the body bytes.

    `body_kept` is False for a response too large (or streamed) to keep, whose effects were
    committed: it replays its status and headers with an empty body.
    """

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    route: str | None = None
    body_kept: bool = True

    @classmethod
    def of(
        cls,
        status: int,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        *,
        route: str | None,
        body_kept: bool = True,
    ) -> StoredResponse:
        kept = tuple(
            (name.lower(), value) for name, value in headers if name.lower() in KEPT_HEADERS
        )
        if not body_kept:
            # No body to describe: what stays is where the created resource is.
            kept = tuple((name, value) for name, value in kept if name in KEPT_WITHOUT_BODY)
        return cls(status, kept, body if body_kept else b"", route, body_kept)

    def to_result(self) -> str:
        """The claim's result (jsonb): the body as text when it is UTF-8 without NUL (jsonb
        holds no NUL), else base64; headers as latin-1 text (one character per byte)."""
        record: dict[str, Any] = {
            "v": RECORD_VERSION,
            "status": self.status,
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in self.headers],
        }
        if self.route is not None:
            record["route"] = self.route
        if not self.body_kept:
            record["body_kept"] = False
        try:
            text = self.body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and "\x00" not in text:
            record["body"] = text
        else:
            record["body_b64"] = base64.b64encode(self.body).decode("ascii")
        # ensure_ascii: every character as an escape jsonb takes back (lone surrogates cannot
        # occur: the text came from a valid UTF-8 decoding).
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_result(cls, result: str | None) -> StoredResponse | None:
        """The stored response, or None when the result is not one of ours."""
        try:
            record = json.loads(result or "null")
            if not isinstance(record, dict) or record.get("v") != RECORD_VERSION:
                return None
            if "body" in record:
                body = str(record["body"]).encode("utf-8")
            else:
                body = base64.b64decode(str(record["body_b64"]), validate=True)
            headers = tuple(
                (str(n).encode("latin-1"), str(v).encode("latin-1")) for n, v in record["headers"]
            )
            route = record.get("route")
            return cls(
                int(record["status"]),
                headers,
                body,
                route if isinstance(route, str) else None,
                record.get("body_kept", True) is not False,
            )
        except (ValueError, TypeError, KeyError, UnicodeEncodeError):
            return None

    async def replay(self, send: Send) -> None:
        """Send it again, marked `Idempotent-Replayed: true`."""
        headers = [*self.headers, (REPLAYED_HEADER, b"true")]
        await send_response(send, self.status, headers, self.body)


def bad_key(detail: str) -> Problem:
    return Problem(400, "invalid-key", "Invalid idempotency key", detail)


def key_required() -> Problem:
    return Problem(
        400,
        "missing-key",
        "Idempotency key required",
        "this endpoint needs an Idempotency-Key header (1-255 visible ASCII characters)",
    )


def no_principal() -> Problem:
    return Problem(
        400,
        "missing-principal",
        "Idempotency key without a caller",
        "a request with an Idempotency-Key must say who sends it (its credentials); keys are "
        "never shared between callers",
    )


def invalid_request(detail: str) -> Problem:
    """400: a function of the middleware's options (fingerprint=, key=, scope=) raised on the
    request; `detail` names the option and the exception's class, never its message."""
    return Problem(400, "invalid-request", "Request cannot be read", detail)


def key_conflict() -> Problem:
    return Problem(
        422,
        "key-conflict",
        "Idempotency key reused",
        "this idempotency key was used for another request (method, path, query or body); "
        "use a new key",
    )


def key_failed() -> Problem:
    return Problem(
        409,
        "key-failed",
        "Idempotency key unusable",
        "this idempotency key has no response to replay (its claim failed); use a new key",
    )


def too_large(limit: int) -> Problem:
    return Problem(
        413,
        "payload-too-large",
        "Payload too large",
        f"a request with an Idempotency-Key may carry at most {limit} bytes of body",
        close=True,
    )


def db_down() -> Problem:
    return unavailable("the idempotency keys' database is unavailable; retry")


def schema_refused() -> Problem:
    """The claims database is not at this server's schema version (never migrated, or another
    version): its log names `dedupe-worker migrate`; the client is not told how to fix it."""
    return unavailable(
        "the idempotency keys' database is not ready for this server (its schema version; "
        "the server's log says what to run)",
        slug="store-not-migrated",
    )


async def answer(send: Send, problem: Problem, outcome: str) -> tuple[str, str | None]:
    """Send a problem; return the outcome for the metrics (no route known)."""
    await problem.send(send)
    return outcome, None


async def answer_for(
    send: Send, request: ClaimRequest, verdict: Verdict, activity: Activity | None
) -> tuple[str, str | None]:
    """The answer to a key this request does not own: its outcome, and the route it replays."""
    fields = {"scope": request.scope, "key": request.key}
    if isinstance(verdict, Duplicate) and verdict.status == "completed":
        stored = StoredResponse.from_result(verdict.result)
        if stored is not None:
            if activity is not None:
                activity.duplicate(request.scope)
            logger.debug("key %s: replayed", request.key, extra={**fields, "outcome": "replayed"})
            await stored.replay(send)
            return "replayed", stored.route
    if isinstance(verdict, Conflict):
        if activity is not None:
            activity.conflict(request.scope)
        logger.info(
            "key %s: reused for another request: 422",
            request.key,
            extra={**fields, "outcome": "conflict"},
        )
        return await answer(send, key_conflict(), "conflict")
    if isinstance(verdict, InFlight):
        return await answer(send, in_flight(), "in_flight")
    if isinstance(verdict, Unavailable):
        logger.warning(
            "key %s: claiming failed (%s)",
            request.key,
            verdict.error,
            extra={**fields, "outcome": "unavailable"},
        )
        return await answer(send, db_down(), "unavailable")
    # Failed for good, or finished by something that stores no response of ours.
    return await answer(send, key_failed(), "refused")


__all__ = [
    "KEPT_HEADERS",
    "NOT_STORED",
    "REPLAYED_HEADER",
    "StoreStatus",
    "StoredResponse",
    "answer",
    "answer_for",
    "bad_key",
    "compile_store_status",
    "db_down",
    "invalid_request",
    "key_conflict",
    "key_failed",
    "key_required",
    "no_principal",
    "schema_refused",
    "too_large",
]
