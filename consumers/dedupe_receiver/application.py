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
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from dedupe.app import App
from dedupe.asgi.problems import unavailable
from dedupe.claims.database import check_schema, redact
from dedupe.claims.store import ClaimStore
from dedupe.errors import ConfigurationError, KeyMissing
from dedupe.message import Headers
from dedupe.observability import tracing
from dedupe.observability.activity import Activity
from dedupe.observability.metrics import Metrics
from dedupe.transport import Publisher
from dedupe.webhooks import Identity, VerificationFailed, WebhookSource
from dedupe_receiver.forwarding import (
    MAX_FORWARDED_HEADER_BYTES,
    forwarded_headers,
    header_list_bytes,
)
from dedupe_receiver.intake import Intake, log_fields
from dedupe_receiver.limits import (
    BadContentLength,
    BodyTooLarge,
    body_limit,
    fitted_message_limit,
    read_body,
)
from dedupe_receiver.probes import readiness
from dedupe_receiver.replies import ProblemOnError, http_problem, problem, respond
from dedupe_receiver.status_page import StatusPage

# The one logger of the receiver's request lines, as in dedupe_receiver.intake and .replies.
logger = logging.getLogger("dedupe_receiver")

# Longest wait for one claims-table statement in a request (claim, store the reply, release).
DEFAULT_STORE_TIMEOUT_S = 3.0


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
        self._intake: Intake | None = None

    def _adopt_limit(self, publisher: object) -> None:
        """Fit every source's body limit under the broker's message limit, or refuse to start."""
        limit = fitted_message_limit(self.app.webhooks.values(), publisher)
        if limit is not None:
            self.message_limit = limit

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
            # The schema gate: a database never migrated, or at another version, refuses the
            # start (SchemaMismatch names `dedupe-worker migrate`), before a webhook is taken.
            where = None if self.database_url is None else redact(self.database_url)
            await check_schema(self.store.pool, where=where)
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
        return await readiness(self.store, self.publisher, publish_timeout_s=self.publish_timeout_s)

    async def webhook(self, request: Request) -> Response:
        """POST /webhooks/{source}: every outcome a client can cause is a 2xx or a 4xx."""
        return await self._webhook(request, _request_headers(request)[1])

    async def _webhook(
        self, request: Request, headers: Headers, *, traced: bool = False
    ) -> Response:
        name = request.path_params["source"]
        source = self.app.webhooks.get(name)
        if source is None:
            return problem(404, "unknown-source", "Unknown webhook source", f"no source {name!r}")
        if not source.accepts(headers.get("content-type")):
            return problem(
                415,
                "unsupported-media-type",
                "Unsupported media type",
                f"send one of: {', '.join(source.content_types)} "
                "(a Content-Type of at most 255 visible ASCII characters)",
            )
        limit = body_limit(source, self.message_limit)
        try:
            body = await read_body(request, limit)
        except (BodyTooLarge, BadContentLength, ClientDisconnect) as exc:
            return _body_refused(exc, limit)
        try:
            identity = source.identify(headers, body)
        except (VerificationFailed, KeyMissing, ConfigurationError) as exc:
            return self._unidentified(source, exc)
        forward = forwarded_headers(headers, source, identity)
        if header_list_bytes(forward) > MAX_FORWARDED_HEADER_BYTES:
            return problem(
                431,
                "headers-too-large",
                "Request header fields too large",
                f"the headers to forward are over {MAX_FORWARDED_HEADER_BYTES} bytes "
                "(name + value + 32 per header)",
            )
        return await self._claim(source, identity, forward, body, traced=traced)

    async def traced_webhook(self, request: Request) -> Response:
        """webhook() in a SERVER span (OpenTelemetry), which the forwarded message carries on;
        without a recording tracer, webhook() alone (the caller's trace headers are forwarded
        as they came)."""
        first, headers = _request_headers(request)
        if not tracing.recording():
            return await self._webhook(request, headers)
        name = request.path_params["source"]
        attributes = {"dedupe.webhook.source": name, "http.request.method": request.method}
        with tracing.server_span(f"dedupe.receive {name}", first, attributes) as span:
            response = await self._webhook(request, headers, traced=True)
            tracing.annotate(span, **{"http.response.status_code": response.status_code})
            return response

    def _unidentified(self, source: WebhookSource, exc: Exception) -> Response:
        """The answer to a request `source` cannot identify: unauthenticated (401), without
        a key (400), or a source that cannot verify at all (500)."""
        if isinstance(exc, VerificationFailed):
            self.stats["unauthenticated"] += 1
            logger.info(
                "webhook %s: 401 (%s)",
                source.name,
                exc,
                extra=log_fields(source, None, "unauthenticated"),
            )
            challenge = source.verify.challenge
            return problem(
                401,
                "unauthenticated",
                "Unauthenticated",
                str(exc),
                headers={"WWW-Authenticate": challenge} if challenge else None,
            )
        if isinstance(exc, KeyMissing):
            return problem(400, "missing-key", "Missing idempotency key", str(exc))
        logger.error(
            "webhook %s cannot verify requests: %s",
            source.name,
            exc,
            extra=log_fields(source, None, "misconfigured"),
        )
        return problem(500, "misconfigured", "Receiver misconfigured", source.name)

    # -- claim, publish, store (consumers/dedupe_receiver/intake.py) ------------------------------

    async def _claim(
        self,
        source: WebhookSource,
        identity: Identity,
        forward: dict[str, str],
        body: bytes,
        *,
        traced: bool,
    ) -> Response:
        store, publisher = self.store, self.publisher
        if store is None or publisher is None:
            return respond(
                unavailable("the receiver has not started (lifespan)", slug="not-started")
            )
        if traced:  # in a recording SERVER span (traced_webhook)
            tracing.annotate_current(**{"dedupe.scope": identity.scope, "dedupe.key": identity.key})
            forward = {**forward, **tracing.trace_headers()}  # the worker's span: our child
        intake = self._intake
        if (
            intake is None
            or intake.store is not store
            or intake.publisher is not publisher
            or intake.activity is not self.activity
        ):
            # Made once per lifespan, not per request (what it holds changes only there).
            intake = self._intake = Intake(
                store=store,
                publisher=publisher,
                activity=self.activity,
                stats=self.stats,
                metrics=self.metrics,
                publish_timeout_s=self.publish_timeout_s,
                store_timeout_s=self.store_timeout_s,
            )
        return await intake.claim(source, identity, forward, body)


def _request_headers(request: Request) -> tuple[dict[str, str], Headers]:
    """The request's headers in one pass over the ASGI list, seen two ways: the first value
    of each name (what Starlette's request.headers answers; the trace context is read from
    it) and dedupe's Headers, the one view for every check and for what is forwarded (of a
    header sent twice, the last one counts everywhere)."""
    first: dict[str, str] = {}
    last: dict[str, str] = {}
    for raw_name, raw_value in request.scope["headers"]:
        name = raw_name.decode("latin-1")
        value = raw_value.decode("latin-1")
        if name not in first:
            first[name] = value
        last[name] = value
    return first, Headers(last)


def _body_refused(exc: Exception, limit: int) -> Response:
    """The answer to a body not taken: over `limit` (413), a bad Content-Length or a client
    gone (400)."""
    if isinstance(exc, BodyTooLarge):
        # Past the discard bound, close: uvicorn would read and drop the rest itself,
        # however much the client sends.
        return problem(
            413,
            "payload-too-large",
            "Payload too large",
            f"the body is over {limit} bytes",
            headers=None if exc.drained else {"Connection": "close"},
        )
    if isinstance(exc, BadContentLength):
        return problem(
            400, "bad-request", "Bad request", "Content-Length is not a decimal byte count"
        )
    return problem(400, "bad-request", "Bad request", "the client went away")


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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
        Route("/webhooks/{source}", receiver.traced_webhook, methods=["POST"]),
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
        middleware=[Middleware(ProblemOnError)],
        exception_handlers={HTTPException: http_problem},
        lifespan=receiver.lifespan,
    )
    asgi.state.receiver = receiver
    return asgi


__all__ = ["DEFAULT_STORE_TIMEOUT_S", "PublisherFactory", "Receiver", "create_receiver"]
