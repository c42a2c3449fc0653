"""The webhook receiver (ASGI): verify, claim, publish with confirms, store and replay the reply.

    POST /webhooks/{source}    GET /healthz    GET /readyz    GET /metrics    GET /status

Served by `dedupe-worker receive MODULE:APP`, or mounted in a FastAPI or Starlette app (see
`create_receiver`). The claim lives in the workers' claims table, under the source's scope
plus the caller's tenant; the stored reply is the claim's result, so the same key with the
same body gets the same status and body again, and never a second publish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import BaseRoute, Route
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the webhook receiver needs starlette and uvicorn: pip install 'dedupe-worker[receiver]'"
    ) from exc

from consumers.status_page import StatusPage
from dedupe.activity import Activity
from dedupe.app import App
from dedupe.errors import ConfigurationError, KeyMissing
from dedupe.message import Headers
from dedupe.metrics import Metrics
from dedupe.store import Claim, ClaimRequest, ClaimStore, Fence
from dedupe.transport import Publisher
from dedupe.webhooks import MAX_MESSAGE_ID_BYTES, Identity, VerificationFailed, WebhookSource

logger = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
REPLAYED_HEADER = "Idempotent-Replayed"
ACCEPTED = 202
# A key in flight is held for milliseconds (one publish); come back soon.
IN_FLIGHT_RETRY_AFTER_S = 1
# The broker or the database is down: give it a moment.
UNAVAILABLE_RETRY_AFTER_S = 5
RECLAIM_TRIES = 3
# Longest wait for one claims-table statement in a request (claim, store the reply, release).
DEFAULT_STORE_TIMEOUT_S = 3.0
# Forwarded headers are counted as HTTP/2 counts a header list (name + value + 32 bytes
# each); the bound keeps an AMQP header frame far under RabbitMQ's frame_max (128 KiB).
MAX_FORWARDED_HEADER_BYTES = 32 * 1024
# What a message needs besides its body where the broker limits a message's size (Kafka's
# max_request_size): the forwarded headers, the message id as record key and as header,
# and the record batch's own fields.
MESSAGE_OVERHEAD_BYTES = MAX_FORWARDED_HEADER_BYTES + 2 * (MAX_MESSAGE_ID_BYTES + 32) + 512
# A broker limit that leaves less than this for a body is a configuration mistake.
MIN_BODY_LIMIT_BYTES = 64 * 1024
# Decimal digits only (str.isdigit() also takes "²"), and few enough for a 64-bit size.
_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")
# The broker refuses the message itself (aiokafka, client- or broker-side): the same request
# fails every time, so it is the client's 413, not a 503 to retry.
_TOO_LARGE_FOR_BROKER = frozenset({"MessageSizeTooLargeError", "RecordTooLargeError"})

# Headers that are never forwarded to the broker: hop-by-hop ones, credentials and
# signatures (a handler has no use for them and they must not sit in a queue), and the
# ones the transports and this receiver set themselves.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "keep-alive",
        "message-id",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_CREDENTIAL = re.compile(
    r"auth|cookie|signature|secret|token|password|passwd|api[-_]?key|credential|^x-dedupe-", re.I
)
SOURCE_HEADER = "x-dedupe-webhook-source"
TENANT_HEADER = "x-dedupe-webhook-tenant"
WEBHOOK_KEY_HEADER = "x-dedupe-webhook-key"


# -- replies -------------------------------------------------------------------------------


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


def forwarded_headers(
    headers: Mapping[str, str], source: WebhookSource, identity: Identity
) -> dict[str, str]:
    """The request's headers minus credentials and hop-by-hop ones, plus the webhook's own."""
    forward = {
        name.lower(): value
        for name, value in headers.items()
        if name.lower() not in _HOP_BY_HOP and not _CREDENTIAL.search(name)
    }
    forward[SOURCE_HEADER] = source.name
    forward[WEBHOOK_KEY_HEADER] = identity.key
    if identity.tenant is not None:
        forward[TENANT_HEADER] = identity.tenant
    return forward


def header_list_bytes(headers: Mapping[str, str]) -> int:
    """The size of a header list as HTTP/2 counts it: UTF-8 name + value + 32 per header."""
    return sum(len(name.encode()) + len(value.encode()) + 32 for name, value in headers.items())


def message_limit(publisher: object) -> int | None:
    """The largest message (body, key and headers) `publisher` can send; None: no known limit.

    A publisher says so with a `max_message_bytes` attribute; KafkaPublisher keeps aiokafka's
    default max_request_size.
    """
    limit = getattr(publisher, "max_message_bytes", None)
    if isinstance(limit, int) and not isinstance(limit, bool):
        return limit
    # Only look when the Kafka module is loaded: otherwise the publisher cannot be one of its.
    kafka = sys.modules.get("consumers.kafka_clients")
    if kafka is not None and isinstance(publisher, kafka.KafkaPublisher):
        from aiokafka import AIOKafkaProducer

        default = inspect.signature(AIOKafkaProducer).parameters["max_request_size"].default
        return int(default)
    return None


def _too_large_for_broker(exc: BaseException) -> bool:
    cause: BaseException | None = exc
    for _ in range(8):  # the publisher's wrapper, the driver's error and its cause
        if cause is None:
            return False
        if any(cls.__name__ in _TOO_LARGE_FOR_BROKER for cls in type(cause).__mro__):
            return True
        cause = cause.__cause__
    return False


class _TooLarge(Exception):
    pass


class _BadLength(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused (before it is all read) once it is over `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not _CONTENT_LENGTH.fullmatch(declared):
            raise _BadLength
        if int(declared) > limit:
            raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


# -- the receiver --------------------------------------------------------------------------


PublisherFactory = Callable[[], Publisher]


def _fields(source: WebhookSource, identity: Identity | None, outcome: str) -> dict[str, str]:
    """The `extra=` of a log line about one request (dedupe.logs prints only these)."""
    fields = {"source": source.name, "channel": source.channel, "outcome": outcome}
    if identity is not None:
        fields.update(scope=identity.scope, key=identity.key, message_id=identity.message_id)
    return fields


class Receiver:
    """Serves an App's webhook sources; `create_receiver` wraps it in a Starlette app."""

    def __init__(
        self,
        app: App,
        *,
        store: ClaimStore | None,
        publisher: Publisher | PublisherFactory,
        database_url: str | None,
        owner: str,
        publish_timeout_s: float,
        store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
        metrics: Metrics | None = None,
        metrics_interval_s: float = 15.0,
    ) -> None:
        self.app = app
        self.store = store
        self.database_url = database_url
        self.owner = owner
        self.publish_timeout_s = publish_timeout_s
        self.store_timeout_s = store_timeout_s
        # The broker's limit on a whole message, once the publisher is known (None: none).
        self.message_limit: int | None = None
        # An instance is the caller's to close; a factory's product is ours.
        self.publisher: Publisher | None = None
        self._publisher_factory: PublisherFactory | None = None
        if callable(getattr(publisher, "publish", None)):
            self.publisher = publisher  # type: ignore[assignment]
            self._adopt_limit(self.publisher)
        else:
            self._publisher_factory = publisher  # type: ignore[assignment]
        self.stats: collections.Counter[str] = collections.Counter()
        self.metrics = metrics or Metrics()
        self.metrics.watch_receiver(self.stats)
        self.metrics_interval_s = metrics_interval_s
        self.activity: Activity | None = None

    def _adopt_limit(self, publisher: object) -> None:
        """Fit every source's body limit under the broker's message limit, or refuse to start."""
        limit = message_limit(publisher)
        if limit is None:
            return
        room = limit - MESSAGE_OVERHEAD_BYTES
        if room < MIN_BODY_LIMIT_BYTES:
            raise ConfigurationError(
                f"the publisher takes messages of at most {limit} bytes, which leaves {room} "
                f"bytes for a body next to up to {MESSAGE_OVERHEAD_BYTES} bytes of headers and "
                f"key; raise the broker's message size limit (Kafka: max_request_size)"
            )
        self.message_limit = limit
        for source in self.app.webhooks.values():
            if source.max_body_bytes > room:
                logger.info(
                    "webhook source %r: bodies over %d bytes are refused with 413 "
                    "(max_body_bytes=%d, but the broker takes messages of at most %d bytes, "
                    "headers and key included)",
                    source.name,
                    room,
                    source.max_body_bytes,
                    limit,
                    extra={"source": source.name, "channel": source.channel},
                )

    def body_limit(self, source: WebhookSource) -> int:
        """The largest body taken for `source`: its max_body_bytes, or less when the broker's
        message limit leaves less room (a 413 then, rather than a 503 on every retry)."""
        if self.message_limit is None:
            return source.max_body_bytes
        return min(source.max_body_bytes, self.message_limit - MESSAGE_OVERHEAD_BYTES)

    # -- lifespan ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, _asgi: object = None) -> AsyncIterator[None]:
        """Check every source's secrets, then open what was not given: store, publisher."""
        for source in self.app.webhooks.values():
            try:
                source.verify.check()
            except ConfigurationError as exc:
                raise ConfigurationError(f"webhook source {source.name!r}: {exc}") from exc
        async with contextlib.AsyncExitStack() as stack:
            if self.store is None:
                if self.database_url is None:
                    raise ConfigurationError(
                        "create_receiver needs store= or database_url= (PostgreSQL)"
                    )
                self.store = await stack.enter_async_context(
                    ClaimStore.open(self.database_url, owner=self.owner, max_size=20)
                )
                stack.callback(setattr, self, "store", None)
            self.activity = await stack.enter_async_context(Activity(self.store))
            stack.callback(setattr, self, "activity", None)
            checking = asyncio.create_task(
                self.metrics.check_claims_every(self.store, self.metrics_interval_s),
                name="dedupe-receiver-metrics",
            )
            stack.push_async_callback(_cancelled, checking)
            if self.publisher is None and self._publisher_factory is not None:
                publisher = self._publisher_factory()
                stack.push_async_callback(publisher.close)
                self._adopt_limit(publisher)
                stack.callback(setattr, self, "publisher", None)
                self.publisher = publisher
                connect = getattr(publisher, "connect", None) or getattr(publisher, "start", None)
                if connect is not None:
                    try:
                        await connect()
                    except Exception as exc:
                        # Serve anyway: /readyz says not ready, requests get 503 and the
                        # publisher connects again on the next one.
                        logger.warning("the broker is not reachable yet: %s", exc)
            logger.info(
                "receiving webhooks for app %r: %s",
                self.app.name,
                ", ".join(f"/webhooks/{s.name} -> {s.channel}" for s in self.app.webhooks.values()),
            )
            yield

    # -- endpoints ---------------------------------------------------------------------

    async def metrics_text(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(
            generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    async def healthz(self, request: Request) -> Response:
        return Response('{"status":"ok"}', media_type="application/json")

    async def readyz(self, request: Request) -> Response:
        checks = {"postgresql": await self._store_ready(), "broker": await self._broker_ready()}
        if all(state in ("ok", "unchecked") for state in checks.values()):
            body = json.dumps({"status": "ready", "checks": checks}, separators=(",", ":"))
            return Response(body, media_type="application/json")
        return problem(
            503,
            "not-ready",
            "Not ready",
            "PostgreSQL or the broker cannot be reached",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
            checks=checks,
        )

    async def _store_ready(self) -> str:
        if self.store is None:
            return "not started"
        try:
            async with asyncio.timeout(2):
                await self.store.pool.fetchval("SELECT 1")
        except Exception:
            return "unavailable"
        return "ok"

    async def _broker_ready(self) -> str:
        if self.publisher is None:
            return "not started"
        ready = getattr(self.publisher, "ready", None)
        if ready is None:
            return "unchecked"  # the publisher cannot tell (no ready()); publishes will
        try:
            async with asyncio.timeout(self.publish_timeout_s):
                return "ok" if await ready() else "unavailable"
        except Exception:
            return "unavailable"

    async def webhook(self, request: Request) -> Response:
        """POST /webhooks/{source}: every outcome a client can cause is a 2xx or a 4xx."""
        name = request.path_params["source"]
        source = self.app.webhooks.get(name)
        if source is None:
            return problem(404, "unknown-source", "Unknown webhook source", f"no source {name!r}")
        # One view of the headers for every check and for what is forwarded: of a header sent
        # twice, the last one counts everywhere.
        headers = Headers(request.headers)
        if not source.accepts(headers.get("content-type")):
            return problem(
                415,
                "unsupported-media-type",
                "Unsupported media type",
                f"send one of: {', '.join(source.content_types)} "
                "(a Content-Type of at most 255 visible ASCII characters)",
            )
        limit = self.body_limit(source)
        try:
            body = await read_body(request, limit)
        except _TooLarge:
            return problem(
                413,
                "payload-too-large",
                "Payload too large",
                f"the body is over {limit} bytes",
                headers={"Connection": "close"},
            )
        except _BadLength:
            return problem(
                400, "bad-request", "Bad request", "Content-Length is not a decimal byte count"
            )
        except ClientDisconnect:
            return problem(400, "bad-request", "Bad request", "the client went away")
        try:
            identity = source.identify(headers, body)
        except VerificationFailed as exc:
            self.stats["unauthenticated"] += 1
            logger.info(
                "webhook %s: 401 (%s)",
                source.name,
                exc,
                extra=_fields(source, None, "unauthenticated"),
            )
            challenge = source.verify.challenge
            return problem(
                401,
                "unauthenticated",
                "Unauthenticated",
                str(exc),
                headers={"WWW-Authenticate": challenge} if challenge else None,
            )
        except KeyMissing as exc:
            return problem(400, "missing-key", "Missing idempotency key", str(exc))
        except ConfigurationError as exc:
            logger.error(
                "webhook %s cannot verify requests: %s",
                source.name,
                exc,
                extra=_fields(source, None, "misconfigured"),
            )
            return problem(500, "misconfigured", "Receiver misconfigured", source.name)
        forward = forwarded_headers(headers, source, identity)
        if header_list_bytes(forward) > MAX_FORWARDED_HEADER_BYTES:
            return problem(
                431,
                "headers-too-large",
                "Request header fields too large",
                f"the headers to forward are over {MAX_FORWARDED_HEADER_BYTES} bytes "
                "(name + value + 32 per header)",
            )
        return await self._claim(source, identity, forward, body)

    # -- claim, publish, store -------------------------------------------------------------

    async def _claim(
        self, source: WebhookSource, identity: Identity, forward: dict[str, str], body: bytes
    ) -> Response:
        store, publisher = self.store, self.publisher
        if store is None or publisher is None:
            return _unavailable("not-started", "the receiver has not started (lifespan)")
        request = ClaimRequest(identity.scope, identity.key, hashlib.sha256(body).digest())
        for _ in range(RECLAIM_TRIES):
            started = time.perf_counter()
            try:
                async with asyncio.timeout(self.store_timeout_s):
                    [claim] = await store.claim_batch(
                        [request], lease_s=source.lease_s, retention_s=source.retention_s
                    )
            except Exception as exc:
                # StoreError, our timeout, or whatever else the driver raised: an outage of
                # ours. A claim that committed just as the timeout struck lapses with its lease.
                self.stats["store_unavailable"] += 1
                logger.warning(
                    "webhook %s: claiming key %s failed (%s: %s)",
                    source.name,
                    identity.key,
                    exc.__class__.__name__,
                    exc,
                    extra=_fields(source, identity, "store_unavailable"),
                )
                return _unavailable("store-unavailable", "the claim store is unavailable")
            self.metrics.claimed(source.scope, time.perf_counter() - started, 1)
            if claim.owned:
                return await self._publish(source, identity, claim, forward, body)
            if claim.status is not None:
                return self._answer_for(source, identity, claim)
            # The row vanished between our insert and our look (clean-up): claim again.
        return _in_flight()

    def _answer_for(self, source: WebhookSource, identity: Identity, claim: Claim) -> Response:
        """The reply to a key we do not own: replay, conflict or come back later."""
        if claim.same_payload is False:
            self.stats["conflicts"] += 1
            if self.activity is not None:
                self.activity.conflict(claim.scope, claim.key, "webhook body differs: 422")
            logger.info(
                "webhook %s: key %s reused with another body: 422",
                source.name,
                claim.key,
                extra=_fields(source, identity, "conflict"),
            )
            return problem(
                422,
                "key-conflict",
                "Idempotency key reused",
                "this idempotency key was used with another body; use a new key",
            )
        if claim.status == "in_progress":
            self.stats["in_flight"] += 1
            return _in_flight()
        stored = Reply.from_result(claim.result)
        if stored is None:
            # A completed key of this scope without a stored reply was not completed by a
            # receiver; the publish happened once, so answer as the publish would have.
            stored = accepted(source, identity)
        self.stats["replayed"] += 1
        if self.activity is not None:
            self.activity.duplicate(claim.scope)
        logger.debug(
            "webhook %s: replayed key %s",
            source.name,
            claim.key,
            extra=_fields(source, identity, "replayed"),
        )
        return stored.response(replayed=True)

    async def _publish(
        self,
        source: WebhookSource,
        identity: Identity,
        claim: Claim,
        forward: dict[str, str],
        body: bytes,
    ) -> Response:
        store, publisher = self.store, self.publisher
        assert store is not None and publisher is not None and claim.token is not None
        fence = Fence(claim.scope, claim.key, claim.token)
        try:
            async with asyncio.timeout(self.publish_timeout_s):
                await publisher.publish(
                    source.channel, body, message_id=identity.message_id, headers=forward
                )
        except asyncio.CancelledError:
            await asyncio.shield(self._give_back(fence))
            raise
        except Exception as exc:
            await self._give_back(fence)
            if _too_large_for_broker(exc):
                self.stats["broker_refused"] += 1
                logger.info(
                    "webhook %s: the broker refused key %s for its size (%s): 413",
                    source.name,
                    claim.key,
                    exc.__class__.__name__,
                    extra=_fields(source, identity, "broker_refused"),
                )
                return problem(
                    413,
                    "payload-too-large",
                    "Payload too large",
                    "the broker refuses a message this large (body and headers)",
                )
            self.stats["broker_unavailable"] += 1
            logger.warning(
                "webhook %s: publishing to %s failed (%s: %s); key %s released for the "
                "sender's retry",
                source.name,
                source.channel,
                exc.__class__.__name__,
                exc,
                claim.key,
                extra=_fields(source, identity, "broker_unavailable"),
            )
            return _unavailable("broker-unavailable", "the broker did not confirm the message")
        reply = accepted(source, identity)
        try:
            async with asyncio.timeout(self.store_timeout_s):
                await store.complete([(fence, reply.to_result(), source.retention_s)])
        except Exception as exc:
            # The message is on the broker: accepted is the truth. A retry after the lease
            # publishes it again under the same message id, and the worker dedupes that.
            logger.warning(
                "webhook %s: key %s published but its reply was not stored (%s: %s)",
                source.name,
                claim.key,
                exc.__class__.__name__,
                exc,
                extra=_fields(source, identity, "reply_not_stored"),
            )
        self.stats["accepted"] += 1
        logger.debug(
            "webhook %s: accepted key %s -> %s",
            source.name,
            claim.key,
            source.channel,
            extra=_fields(source, identity, "accepted"),
        )
        return reply.response()

    async def _give_back(self, fence: Fence) -> None:
        """Release the key at once, so the sender's retry takes it over without waiting."""
        assert self.store is not None
        try:
            async with asyncio.timeout(self.store_timeout_s):
                await self.store.give_back(fence)
        except Exception as exc:
            logger.warning(
                "could not release key %s (%s: %s); its lease expires",
                fence.key,
                exc.__class__.__name__,
                exc,
                extra={"scope": fence.scope, "key": fence.key, "outcome": "not_released"},
            )


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _in_flight() -> Response:
    return problem(
        409,
        "in-flight",
        "Request in flight",
        "a request with this idempotency key is being processed; retry shortly",
        headers={"Retry-After": str(IN_FLIGHT_RETRY_AFTER_S)},
    )


def _unavailable(slug: str, detail: str) -> Response:
    return problem(
        503,
        slug,
        "Service unavailable",
        detail,
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


async def _http_problem(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 as problem+json."""
    assert isinstance(exc, HTTPException)
    return problem(
        exc.status_code,
        "http-error",
        str(exc.detail),
        headers=exc.headers,
    )


class _ProblemOnError:
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


def create_receiver(
    app: App,
    *,
    publisher: Publisher | PublisherFactory,
    store: ClaimStore | None = None,
    database_url: str | None = None,
    owner: str | None = None,
    publish_timeout_s: float = 5.0,
    store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
    status_token: str | None = None,
    serve_status: bool = True,
    serve_metrics: bool = True,
    metrics: Metrics | None = None,
    metrics_interval_s: float = 15.0,
) -> Starlette:
    """A Starlette app serving `app`'s webhook sources.

    A publisher instance and a store are used as given (you open and close them); a
    publisher factory and a database URL are opened and closed by the app's lifespan. When
    you mount the receiver in another app, run its lifespan from yours:
    `async with receiver.router.lifespan_context(receiver): yield`.

    Args:
        app: The App whose webhook sources are served.
        publisher: A Publisher (e.g. RabbitMQPublisher(url)) or a callable making one.
        store: An open ClaimStore; or pass database_url.
        database_url: PostgreSQL URL of the claims, opened by the lifespan.
        owner: Written on claims (default: receiver@host:pid).
        publish_timeout_s: Longest wait for the broker's confirm before answering 503.
        store_timeout_s: Longest wait for one claims-table statement (claim, store the
            reply, release) before answering 503.
        status_token: Needed to release keys from /status, and to view it from a client
            that is not on the loopback interface (without a token, only loopback clients
            may view or release).
        serve_status: Serve /status; False leaves it to `dedupe-worker status --serve`.
        serve_metrics: Serve /metrics.
        metrics: Where /metrics reads from (default: a registry of the receiver's own).
        metrics_interval_s: Period of the claims-table gauges.
    """
    if not app.webhooks:
        raise ConfigurationError(
            f"app {app.name!r} declares no webhook sources; add one with app.webhook(...)"
        )
    for name, value in (
        ("publish_timeout_s", publish_timeout_s),
        ("store_timeout_s", store_timeout_s),
        ("metrics_interval_s", metrics_interval_s),
    ):
        if not value > 0:
            raise ConfigurationError(f"{name}={value!r} must be a positive number of seconds")
    for source in app.webhooks.values():
        if publish_timeout_s >= source.lease_s:
            raise ConfigurationError(
                f"webhook source {source.name!r}: lease_s={source.lease_s:g} must be longer "
                f"than publish_timeout_s={publish_timeout_s:g}"
            )
    receiver = Receiver(
        app,
        store=store,
        publisher=publisher,
        database_url=database_url,
        owner=owner or f"receiver@{socket.gethostname()}:{os.getpid()}",
        publish_timeout_s=publish_timeout_s,
        store_timeout_s=store_timeout_s,
        metrics=metrics,
        metrics_interval_s=metrics_interval_s,
    )
    routes: list[BaseRoute] = [
        Route("/webhooks/{source}", receiver.webhook, methods=["POST"]),
        Route("/healthz", receiver.healthz, methods=["GET"]),
        Route("/readyz", receiver.readyz, methods=["GET"]),
    ]
    if serve_metrics:
        routes.append(Route("/metrics", receiver.metrics_text, methods=["GET"]))
    if serve_status:
        # On the webhook port the whole internet may knock: the page shows keys, tenants
        # and errors, so only operators see it (the token, or a loopback client).
        status = StatusPage(
            lambda: receiver.store,
            token=status_token,
            title=f"{app.name} receiver",
            operators_only=True,
        )
        routes.extend(status.routes())
    asgi = Starlette(
        routes=routes,
        middleware=[Middleware(_ProblemOnError)],
        exception_handlers={HTTPException: _http_problem},
        lifespan=receiver.lifespan,
    )
    asgi.state.receiver = receiver
    return asgi


__all__ = ["Receiver", "Reply", "create_receiver", "forwarded_headers", "problem"]
