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
import json
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the webhook receiver needs starlette and uvicorn: pip install 'dedupe-worker[receiver]'"
    ) from exc

from consumers.status_page import StatusPage
from dedupe.activity import Activity
from dedupe.app import App
from dedupe.errors import ConfigurationError, KeyMissing, StoreError
from dedupe.message import Headers
from dedupe.metrics import Metrics
from dedupe.store import Claim, ClaimRequest, ClaimStore, Fence
from dedupe.transport import Publisher
from dedupe.webhooks import Identity, VerificationFailed, WebhookSource

logger = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
REPLAYED_HEADER = "Idempotent-Replayed"
ACCEPTED = 202
# A key in flight is held for milliseconds (one publish); come back soon.
IN_FLIGHT_RETRY_AFTER_S = 1
# The broker or the database is down: give it a moment.
UNAVAILABLE_RETRY_AFTER_S = 5
RECLAIM_TRIES = 3

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
    headers: Headers, source: WebhookSource, identity: Identity
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


class _TooLarge(Exception):
    pass


class _BadLength(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused (before it is all read) once it is over `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
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
        metrics: Metrics | None = None,
        metrics_interval_s: float = 15.0,
    ) -> None:
        self.app = app
        self.store = store
        self.database_url = database_url
        self.owner = owner
        self.publish_timeout_s = publish_timeout_s
        # An instance is the caller's to close; a factory's product is ours.
        self.publisher: Publisher | None = None
        self._publisher_factory: PublisherFactory | None = None
        if callable(getattr(publisher, "publish", None)):
            self.publisher = publisher  # type: ignore[assignment]
        else:
            self._publisher_factory = publisher  # type: ignore[assignment]
        self.stats: collections.Counter[str] = collections.Counter()
        self.metrics = metrics or Metrics()
        self.metrics.watch_receiver(self.stats)
        self.metrics_interval_s = metrics_interval_s
        self.activity: Activity | None = None

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
        if not source.accepts(request.headers.get("content-type")):
            return problem(
                415,
                "unsupported-media-type",
                "Unsupported media type",
                f"send one of: {', '.join(source.content_types)}",
            )
        try:
            body = await read_body(request, source.max_body_bytes)
        except _TooLarge:
            return problem(
                413,
                "payload-too-large",
                "Payload too large",
                f"the body is over {source.max_body_bytes} bytes",
                headers={"Connection": "close"},
            )
        except _BadLength:
            return problem(400, "bad-request", "Bad request", "Content-Length is not a number")
        except ClientDisconnect:
            return problem(400, "bad-request", "Bad request", "the client went away")
        headers = Headers(request.headers)
        try:
            identity = source.identify(headers, body)
        except VerificationFailed as exc:
            self.stats["unauthenticated"] += 1
            logger.info("webhook %s: 401 (%s)", source.name, exc)
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
            logger.error("webhook %s cannot verify requests: %s", source.name, exc)
            return problem(500, "misconfigured", "Receiver misconfigured", source.name)
        return await self._claim(source, identity, headers, body)

    # -- claim, publish, store -------------------------------------------------------------

    async def _claim(
        self, source: WebhookSource, identity: Identity, headers: Headers, body: bytes
    ) -> Response:
        store, publisher = self.store, self.publisher
        if store is None or publisher is None:
            return _unavailable("not-started", "the receiver has not started (lifespan)")
        request = ClaimRequest(identity.scope, identity.key, hashlib.sha256(body).digest())
        for _ in range(RECLAIM_TRIES):
            try:
                [claim] = await store.claim_batch(
                    [request], lease_s=source.lease_s, retention_s=source.retention_s
                )
            except StoreError as exc:
                logger.warning("webhook %s: the claim store is unavailable: %s", source.name, exc)
                return _unavailable("store-unavailable", "the claim store is unavailable")
            if claim.owned:
                return await self._publish(source, identity, claim, headers, body)
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
            logger.info("webhook %s: key %s reused with another body: 422", source.name, claim.key)
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
        logger.debug("webhook %s: replayed key %s", source.name, claim.key)
        return stored.response(replayed=True)

    async def _publish(
        self,
        source: WebhookSource,
        identity: Identity,
        claim: Claim,
        headers: Headers,
        body: bytes,
    ) -> Response:
        store, publisher = self.store, self.publisher
        assert store is not None and publisher is not None and claim.token is not None
        fence = Fence(claim.scope, claim.key, claim.token)
        try:
            async with asyncio.timeout(self.publish_timeout_s):
                await publisher.publish(
                    source.channel,
                    body,
                    message_id=identity.message_id,
                    headers=forwarded_headers(headers, source, identity),
                )
        except asyncio.CancelledError:
            await asyncio.shield(self._give_back(fence))
            raise
        except Exception as exc:
            self.stats["broker_unavailable"] += 1
            logger.warning(
                "webhook %s: publishing to %s failed (%s: %s); key %s released for the "
                "sender's retry",
                source.name,
                source.channel,
                exc.__class__.__name__,
                exc,
                claim.key,
            )
            await self._give_back(fence)
            return _unavailable("broker-unavailable", "the broker did not confirm the message")
        reply = accepted(source, identity)
        try:
            await store.complete([(fence, reply.to_result(), source.retention_s)])
        except StoreError as exc:
            # The message is on the broker: accepted is the truth. A retry after the lease
            # publishes it again under the same message id, and the worker dedupes that.
            logger.warning(
                "webhook %s: key %s published but its reply was not stored: %s",
                source.name,
                claim.key,
                exc,
            )
        self.stats["accepted"] += 1
        logger.debug("webhook %s: accepted key %s -> %s", source.name, claim.key, source.channel)
        return reply.response()

    async def _give_back(self, fence: Fence) -> None:
        """Release the key at once, so the sender's retry takes it over without waiting."""
        assert self.store is not None
        try:
            await self.store.give_back(fence)
        except StoreError as exc:
            logger.warning("could not release key %s (%s); its lease expires", fence.key, exc)


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


def create_receiver(
    app: App,
    *,
    publisher: Publisher | PublisherFactory,
    store: ClaimStore | None = None,
    database_url: str | None = None,
    owner: str | None = None,
    publish_timeout_s: float = 5.0,
    status_token: str | None = None,
    metrics: Metrics | None = None,
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
        status_token: Required to release keys from /status (default: loopback clients only).
        metrics: Where /metrics reads from (default: a registry of the receiver's own).
    """
    if not app.webhooks:
        raise ConfigurationError(
            f"app {app.name!r} declares no webhook sources; add one with app.webhook(...)"
        )
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
        metrics=metrics,
    )
    status = StatusPage(lambda: receiver.store, token=status_token, title=f"{app.name} receiver")
    asgi = Starlette(
        routes=[
            Route("/webhooks/{source}", receiver.webhook, methods=["POST"]),
            Route("/healthz", receiver.healthz, methods=["GET"]),
            Route("/readyz", receiver.readyz, methods=["GET"]),
            Route("/metrics", receiver.metrics_text, methods=["GET"]),
            *status.routes(),
        ],
        exception_handlers={HTTPException: _http_problem},
        lifespan=receiver.lifespan,
    )
    asgi.state.receiver = receiver
    return asgi


__all__ = ["Receiver", "Reply", "create_receiver", "forwarded_headers", "problem"]
