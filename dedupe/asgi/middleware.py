"""`IdempotencyMiddleware`: a user's own HTTP endpoints made idempotent on the claims table
(plain ASGI, no web framework: FastAPI, Starlette, Litestar or any ASGI app).

A covered request (POST, PATCH) with an `Idempotency-Key` claims `(<app>.http/<principal
hash>, key)` with the fingerprint of its method, path, query and body. Ours: the endpoint
runs, and its `request.state.idempotency.db` writes commit with its stored response before the
first byte goes out (dedupe.asgi.run). A finished key replays; another request under the key is
a 422; one still running a 409 (or a wait of up to `wait_s`). See docs/http-api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Collection

from dedupe.app import App
from dedupe.asgi.conflicts import recorded
from dedupe.asgi.intake import read_keyed
from dedupe.asgi.keys import KeyRefused, key_of
from dedupe.asgi.problems import ASGIMessage, Problem, Send, in_flight
from dedupe.asgi.replies import answer, answer_for, bad_key, db_down, key_required
from dedupe.asgi.run import (
    STORE_TIMEOUT_S,
    ASGIApp,
    HttpLeases,
    KeyedRun,
    Receive,
    Scope,
    run_unkeyed,
)
from dedupe.asgi.state import Idempotency
from dedupe.claims.database import connect_pool
from dedupe.claims.keys import KeySpec, compile_key
from dedupe.claims.records import ClaimRequest
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import Claims, InFlight, Ours, Terms, Unavailable, Verdict
from dedupe.context import Database
from dedupe.effects.run_effects import RunEffects
from dedupe.errors import ConfigurationError, StoreError
from dedupe.observability.activity import Activity
from dedupe.observability.metrics import Metrics

logger = logging.getLogger("dedupe.asgi")

# A response is kept (and replayed) up to this many body bytes; see docs/http-api.md for what
# a larger or streamed one gets.
MAX_RESPONSE_BYTES = 1024 * 1024
# The body of a keyed request is read whole (it is fingerprinted before the endpoint runs).
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Route labels of the metrics beyond this many distinct ones are counted as "other" (paths of
# unrouted requests are the client's to choose).
MAX_ROUTE_LABELS = 200
# A waiting duplicate asks again after this long, then half as long again each time, up to the
# cap: a finished first request is seen within ~50 ms, a long one costs a statement per 0.5 s.
WAIT_FIRST_S = 0.05
WAIT_MAX_S = 0.5
POOL_MAX_SIZE = 20  # the endpoints' transactions and the completions
CLAIM_POOL_MAX_SIZE = 10  # claims, heartbeats, attempt counts


class IdempotencyMiddleware:
    """Idempotency keys for an ASGI app's unsafe requests, on dedupe-worker's claims table.

    Args:
        app: The ASGI app to wrap (positional, as for every ASGI middleware).
        dedupe_app: The App whose name scopes the keys (`<name>.http`).
        database_url: PostgreSQL of the claims (migrated with `dedupe-worker migrate`).
        scope: Whose key it is: a key spec ("header:Authorization", the default) or a
            callable (dedupe.Message) -> str | None read from the request; stored only as
            its SHA-256. None scopes the keys by the app alone.
        methods: The methods covered; others pass straight through.
        required: A covered request without Idempotency-Key is a 400 (False: it runs
            unprotected, in a transaction of its own).
        wait_s: How long a duplicate of a request still running waits for its answer
            before it gets a 409.
        lease_s: How long a claim holds its key without a heartbeat (a crashed process's
            keys are free again after it).
        retention_s: How long a response is kept and replayed.
        max_body_bytes: The largest body of a keyed request (413 past it).
        metrics: Where `dedupe_http_requests_total{route,outcome}` is counted.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        dedupe_app: App,
        database_url: str,
        scope: KeySpec | None = "header:Authorization",
        methods: Collection[str] = ("POST", "PATCH"),
        required: bool = False,
        wait_s: float = 0.0,
        lease_s: float = 30.0,
        retention_s: float = 86_400.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        metrics: Metrics | None = None,
    ) -> None:
        if not isinstance(dedupe_app, App):
            raise ConfigurationError("IdempotencyMiddleware: dedupe_app must be a dedupe.App")
        if "http" in dedupe_app.handlers:
            raise ConfigurationError(
                f"IdempotencyMiddleware: app {dedupe_app.name!r} has a handler named 'http', "
                f"whose keys share the scope {dedupe_app.name}.http; rename the handler"
            )
        if not isinstance(database_url, str) or not database_url:
            raise ConfigurationError("IdempotencyMiddleware: database_url= is required")
        if isinstance(methods, str) or not methods:
            raise ConfigurationError("IdempotencyMiddleware: methods= is a tuple such as ('POST',)")
        for name, value in (("lease_s", lease_s), ("retention_s", retention_s)):
            if not value > 0:
                raise ConfigurationError(f"IdempotencyMiddleware: {name}={value!r} must be > 0")
        if not wait_s >= 0:
            raise ConfigurationError(f"IdempotencyMiddleware: wait_s={wait_s!r} must be >= 0")
        if retention_s < lease_s:
            raise ConfigurationError(
                f"IdempotencyMiddleware: retention_s={retention_s:g} is shorter than "
                f"lease_s={lease_s:g}: a retry could run a finished request again"
            )
        if not max_body_bytes > 0:
            raise ConfigurationError("IdempotencyMiddleware: max_body_bytes must be > 0")
        self.app = app
        self.dedupe_app = dedupe_app
        self.database_url = database_url
        self.scope_func = None if scope is None else compile_key(scope)
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.wait_s = float(wait_s)
        self.terms = Terms(float(lease_s), float(retention_s))
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics or Metrics()
        self.owner = f"http@{socket.gethostname()}:{os.getpid()}"
        self.store: ClaimStore | None = None
        self._claims: Claims | None = None
        self._leases: HttpLeases | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._activity: Activity | None = None
        self._opening = asyncio.Lock()
        self._routes: set[str] = set()

    # -- the pool: opened at lifespan startup or on the first covered request ------------------

    async def open(self) -> ClaimStore:
        """Connect the pool (once) and start the heartbeat; StoreError when unreachable."""
        async with self._opening:
            if self.store is not None:
                return self.store
            stack = contextlib.AsyncExitStack()
            try:
                pool = await connect_pool(self.database_url, max_size=POOL_MAX_SIZE)
                stack.push_async_callback(pool.close)
                # Claims and heartbeats on connections of their own: they never wait behind an
                # endpoint's transaction for a connection.
                claim_pool = await connect_pool(self.database_url, max_size=CLAIM_POOL_MAX_SIZE)
                stack.push_async_callback(claim_pool.close)
            except BaseException:
                await stack.aclose()
                raise
            store = ClaimStore(pool, owner=self.owner)
            claim_store = ClaimStore(claim_pool, owner=self.owner)
            leases = HttpLeases(claim_store, self.terms.lease_s)
            beating = asyncio.create_task(leases.beat_every(), name="dedupe-http-heartbeat")
            stack.push_async_callback(_cancelled, beating)
            self._activity = await stack.enter_async_context(Activity(store))
            self._claims, self._leases, self._stack = Claims(claim_store), leases, stack
            self.store = store
            return store

    async def close(self) -> None:
        """Stop the heartbeat, flush the counts, close the pool; safe to call twice."""
        stack, self._stack, self.store = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receiving() -> ASGIMessage:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.open()
                except StoreError as exc:
                    # Serve anyway: uncovered requests work, covered ones get a 503 and the
                    # pool is opened again on the next one.
                    logger.warning("the claims database is not reachable yet: %s", exc)
            return message

        async def sending(message: ASGIMessage) -> None:
            if message["type"] in (
                "lifespan.startup.failed",
                "lifespan.shutdown.complete",
                "lifespan.shutdown.failed",
            ):
                await self.close()
            await send(message)

        await self.app(scope, receiving, sending)

    # -- requests ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
        else:
            tally = _Tally()
            try:
                tally.outcome, tally.route = await self._serve(scope, receive, send, tally)
            finally:
                self.metrics.http_answered(self._route_label(scope, tally.route), tally.outcome)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, tally: _Tally
    ) -> tuple[str, str | None]:
        """Answer a covered request; return its outcome and route (when known)."""
        headers = scope.get("headers", [])
        try:
            key = key_of(headers)
        except KeyRefused as exc:
            return await answer(send, bad_key(str(exc)), "refused")
        if key is None:
            if self.required:
                return await answer(send, key_required(), "refused")
            store = await self._store_or_none()
            if store is None:
                return await answer(send, db_down(), "unavailable")
            state = scope.setdefault("state", {})
            db = Database(store.pool)
            state["idempotency"] = Idempotency(db=db, key=None, scope=None)
            tally.outcome = "unkeyed"  # also when the endpoint raises
            return await run_unkeyed(self.app, scope, receive, send, db), None
        keyed = await read_keyed(
            scope,
            receive,
            key=key,
            app_name=self.dedupe_app.name,
            scope_func=self.scope_func,
            max_body_bytes=self.max_body_bytes,
        )
        if keyed is None:
            return "refused", None  # the client went away before its body arrived
        if isinstance(keyed, Problem):
            return await answer(send, keyed, "refused")
        return await self._claimed(scope, receive, send, keyed.request, keyed.body, tally)

    async def _claimed(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request: ClaimRequest,
        body: bytes,
        tally: _Tally,
    ) -> tuple[str, str | None]:
        """Run the endpoint under the key's claim, or answer for the claim held elsewhere."""
        store = await self._store_or_none()
        if store is None or self._claims is None or self._leases is None:
            return await answer(send, db_down(), "unavailable")
        verdict = await self._claim_or_wait(request)
        if not isinstance(verdict, Ours):
            verdict = await recorded(store, scope, request, verdict)  # a 422 is recorded first
            return await answer_for(send, request, verdict, self._activity)
        attempt = verdict.attempts
        if verdict.taken_over or verdict.handed_back:
            counted = await self._count_rerun(self._claims, verdict, request)
            if counted is None:
                return await answer(send, in_flight(), "in_flight")
            attempt = counted
        db = Database(store.pool)
        run = KeyedRun(
            app=self.app,
            store=store,
            leases=self._leases,
            fence=verdict.fence,
            attempt=attempt,
            retention_s=self.terms.retention_s,
            max_response_bytes=MAX_RESPONSE_BYTES,
            db=db,
            send=send,
        )
        run.effects = RunEffects(db, verdict.fence, cancel=run.lose)
        scope.setdefault("state", {})["idempotency"] = Idempotency(
            db=db, key=request.key, scope=request.scope, attempt=attempt, effects=run.effects
        )
        try:
            await run(scope, _body_first(body, receive))
        finally:
            # Also when the endpoint raised: its exception goes on to the server.
            tally.outcome, tally.route = run.outcome, run.route
            if run.outcome == "released_on_error":
                logger.info(
                    "key %s: the endpoint failed; nothing kept, the key is released",
                    request.key,
                    extra={"scope": request.scope, "key": request.key, "outcome": run.outcome},
                )
        return run.outcome, run.route

    async def _claim_or_wait(self, request: ClaimRequest) -> Verdict:
        """Claim the key; one still running is asked again, at growing pauses, for up to
        wait_s."""
        verdict = await self._claim(request, first=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        pause = WAIT_FIRST_S
        while isinstance(verdict, InFlight) and loop.time() + pause <= deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, WAIT_MAX_S)
            verdict = await self._claim(request, first=False)
        return verdict

    async def _count_rerun(self, claims: Claims, ours: Ours, request: ClaimRequest) -> int | None:
        """A re-run (after a crash, a 5xx or an operator's release) is counted before it runs:
        its attempt number, or None when the key is no longer ours."""
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                return await claims.store.record_attempt(
                    ours.fence,
                    attempt=ours.attempts + 1,
                    error=None,
                    lease_s=self.terms.lease_s,
                )
        except (StoreError, TimeoutError) as exc:
            logger.warning("key %s: counting the attempt failed: %s", request.key, exc)
            return ours.attempts + 1

    async def _claim(self, request: ClaimRequest, *, first: bool) -> Verdict:
        assert self._claims is not None
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                if first:  # concurrent requests share one claim statement
                    [verdict] = await self._claims.claim("http", self.terms, [request])
                    return verdict
                return await self._claims.claim_one(self.terms, request)
        except TimeoutError:
            return Unavailable("the claim statement timed out")

    async def _store_or_none(self) -> ClaimStore | None:
        if self.store is not None:
            return self.store
        try:
            return await self.open()
        except StoreError as exc:
            logger.warning("the claims database is unreachable: %s", exc)
            return None

    def _route_label(self, scope: Scope, route: str | None) -> str:
        label = route or getattr(scope.get("route"), "path", None) or str(scope.get("path", ""))
        if label in self._routes:
            return label
        if len(self._routes) >= MAX_ROUTE_LABELS:
            return "other"
        self._routes.add(label)
        return label


# -- helpers ---------------------------------------------------------------------------------


class _Tally:
    """What a request came to, for the metrics: set as it goes, read when it ends."""

    __slots__ = ("outcome", "route")

    def __init__(self) -> None:
        self.outcome = "refused"
        self.route: str | None = None


def _body_first(body: bytes, receive: Receive) -> Receive:
    """The endpoint's receive: the body, read already to fingerprint it, then the rest of the
    conversation (a disconnect) as the server tells it."""
    sent = False

    async def replaying() -> ASGIMessage:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replaying


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = ["MAX_RESPONSE_BYTES", "IdempotencyMiddleware"]
