"""`IdempotencyMiddleware`: a user's own HTTP endpoints made idempotent on the claims table
(plain ASGI, no web framework: FastAPI, Starlette, Litestar or any ASGI app).

A covered request (POST, PATCH) with a key (the `Idempotency-Key` header, or where `key=` says:
a form field, a JSON body path) claims `(<app>.http/<principal HMAC>, key)` with the
fingerprint of its method, path, query and body. Ours: the endpoint runs, and its
`request.state.idempotency.db` writes commit with its stored response before the first byte
goes out (dedupe.asgi.run); answers that are not stored (401, 403, 408, 409, 425, 429, 5xx, or
as `store_status=` says) roll back and give the key back. A finished key replays; another
request under the key is a 422; one still running a 409 (or a wait of up to `wait_s`). With
`one_transaction=`, a new key's claim commits with the response in one transaction
(dedupe.asgi.one_transaction). See docs/http-api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Callable, Collection

import asyncpg

from dedupe.app import App
from dedupe.asgi import one_transaction as one_tx
from dedupe.asgi.conflicts import recorded
from dedupe.asgi.intake import option_failed, read_body, read_keyed, request_line
from dedupe.asgi.keys import (
    DEFAULT_KEY_SPEC,
    MIN_SECRET_BYTES,
    KeyRefused,
    RequestLine,
    SourceFailed,
    compile_key_source,
    compile_principal,
)
from dedupe.asgi.problems import ASGIMessage, Problem, Send, in_flight
from dedupe.asgi.replies import (
    StoreStatus,
    answer,
    answer_for,
    bad_key,
    compile_store_status,
    db_down,
    key_required,
    schema_refused,
)
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
from dedupe.claims.database import (
    LOCK_TIMEOUT_S,
    TRANSIENT_ERRORS,
    TransactionBounds,
    check_schema,
    connect_pool,
    redact,
)
from dedupe.claims.fingerprints import FingerprintSpec, compile_fingerprint
from dedupe.claims.keys import KeySpec
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import (
    Claims,
    Duplicate,
    InFlight,
    Ours,
    Terms,
    Unavailable,
    Verdict,
)
from dedupe.context import Database
from dedupe.effects.run_effects import RunEffects
from dedupe.errors import ConfigurationError, SchemaMismatch, StoreError
from dedupe.observability import tracing
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
# Where the secret of the principals' HMAC is read when principal_secret= is not given.
SECRET_ENV = "DEDUPE_HTTP_SECRET"
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
            its HMAC-SHA256 under `principal_secret`. None scopes the keys by the app alone.
        principal_secret: The key of that HMAC (at least 16 bytes, the same in every
            process of the API); default: the DEDUPE_HTTP_SECRET variable. Required with
            `scope=`; without one a key derived from the PostgreSQL cluster (logged as a
            warning at start).
        key: Where the idempotency key is: "header:Idempotency-Key" (the default),
            "form:NAME" (a field of an urlencoded or multipart body), "body:dotted.path" (a
            JSON body), several joined by "|", or a callable (dedupe.Message) -> str | None.
        fingerprint: What "the same request" is: "raw" (the body bytes, the default), "json"
            (the JSON value: key order and whitespace do not matter) or a callable
            (dedupe.Message) -> bytes; the method, path and query always count.
        fingerprint_exclude: With "json", dotted body paths left out ("sent_at", ...).
        store_status: Which answers below 500 are stored: a set of the statuses never stored
            (default NOT_STORED: 401, 403, 408, 409, 425, 429) or a callable (status) -> bool,
            True to store. A 5xx is never stored.
        methods: The methods covered; others pass straight through.
        required: A covered request without a key is a 400 (False: it runs unprotected, in
            a transaction of its own).
        wait_s: How long a duplicate of a request still running waits for its answer
            before it gets a 409.
        lease_s: How long a claim holds its key without a heartbeat (a crashed process's
            keys are free again after it).
        retention_s: How long a response is kept and replayed.
        one_transaction: Which keyed requests claim, run and store in one transaction (one
            commit): True, False (the default: two commits, a claim then the response) or a
            callable (method, path) -> bool. Such a request is bounded by lease_s (past it:
            rolled back, a 503 whose retry runs on two commits); a duplicate of it waits for
            it up to a third of the lease (2 s at most). Not with wait_s > 0, nor for routes
            that call request.state.idempotency.step. See docs/http-api.md.
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
        principal_secret: str | bytes | None = None,
        key: KeySpec = DEFAULT_KEY_SPEC,
        fingerprint: FingerprintSpec = "raw",
        fingerprint_exclude: tuple[str, ...] = (),
        store_status: StoreStatus | None = None,
        methods: Collection[str] = ("POST", "PATCH"),
        required: bool = False,
        wait_s: float = 0.0,
        lease_s: float = 30.0,
        retention_s: float = 86_400.0,
        one_transaction: bool | Callable[[str, str], bool] = False,
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
        if one_transaction is not False and wait_s > 0:
            raise ConfigurationError(
                "IdempotencyMiddleware: one_transaction= and wait_s > 0 exclude each other: a "
                "duplicate of a one-transaction request waits on its row lock (up to "
                f"{LOCK_TIMEOUT_S:g} s) holding a pooled connection, "
                "where wait_s= waiters poll without one; use one or the other"
            )
        try:
            self.one_transaction = one_tx.compile_one_transaction(one_transaction)
        except TypeError as exc:
            raise ConfigurationError(f"IdempotencyMiddleware: {exc}") from None
        self.secret = _principal_secret(principal_secret, scoped=scope is not None)
        self.key_source = compile_key_source(key)
        self.scheme = compile_fingerprint(
            fingerprint, exclude=fingerprint_exclude, where="IdempotencyMiddleware"
        )
        self.stores = compile_store_status(store_status)
        self.app = app
        self.dedupe_app = dedupe_app
        self.database_url = database_url
        self.principal = None if scope is None else compile_principal(scope)
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.wait_s = float(wait_s)
        self.terms = Terms(float(lease_s), float(retention_s))
        self.bounds = TransactionBounds.of(float(lease_s))
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics or Metrics()
        self.owner = f"http@{socket.gethostname()}:{os.getpid()}"
        self.store: ClaimStore | None = None
        self._claims: Claims | None = None
        self._leases: HttpLeases | None = None
        self._look_ups: one_tx.LookUps | None = None
        self._read_first = one_tx.ReadFirst()
        self._stack: contextlib.AsyncExitStack | None = None
        self._activity: Activity | None = None
        self._opening = asyncio.Lock()
        self._routes: set[str] = set()

    # -- the pool: opened at lifespan startup or on the first covered request ------------------
    #
    # The schema gate: open() refuses a database never migrated, or at another schema version
    # than this code's (SchemaMismatch, naming `dedupe-worker migrate`). In an ASGI lifespan
    # the server is told the startup failed (uvicorn logs the message and exits); without
    # one, every covered request gets a 503 `store-not-migrated` and an error in the log,
    # until the database is migrated (the next request then opens it).

    async def open(self) -> ClaimStore:
        """Connect the pool (once), pass the schema gate and start the heartbeat; StoreError
        when unreachable, SchemaMismatch when not migrated to this code's version."""
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
                await check_schema(pool, where=redact(self.database_url))
                if self.secret is None and self.principal is not None:
                    self.secret = await _database_secret(pool)
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
            self._look_ups = one_tx.LookUps(claim_pool)
            self.store = store
            return store

    async def close(self) -> None:
        """Stop the heartbeat, flush the counts, close the pool; safe to call twice."""
        stack, self._stack, self.store = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused: list[SchemaMismatch] = []

        async def receiving() -> ASGIMessage:
            if refused:  # the server was told the startup failed: the app shuts down now
                return {"type": "lifespan.shutdown"}
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.open()
                except StoreError as exc:
                    # Serve anyway: uncovered requests work, covered ones get a 503 and the
                    # pool is opened again on the next one.
                    logger.warning("the claims database is not reachable yet: %s", exc)
                except SchemaMismatch as exc:
                    logger.error("IdempotencyMiddleware refuses to start: %s", exc)
                    refused.append(exc)
            return message

        async def sending(message: ASGIMessage) -> None:
            if refused:
                if message["type"] == "lifespan.startup.complete":
                    message = {
                        "type": "lifespan.startup.failed",
                        "message": f"IdempotencyMiddleware: {refused[0]}",
                    }
                elif message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                    return  # the app's own shutdown, after the failed startup: not the server's
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
        elif not tracing.recording():  # no span to open: the caller's trace headers pass on
            carried = tracing.callers_headers(scope)
            if carried is None:  # no trace context sent: none to make current
                await self._answer(scope, receive, send, _Tally())
            else:
                with tracing.callers_context(carried):  # current for its publishes
                    await self._answer(scope, receive, send, _Tally())
        else:
            tally = _Tally(traced=True)
            name = f"dedupe.http {scope['method']}"
            headers = tracing.asgi_headers(scope)
            with tracing.server_span(
                name, headers, {"http.request.method": scope["method"]}
            ) as span:
                scope = tracing.with_trace_headers(scope)  # the endpoint's spans: our children
                try:
                    await self._answer(scope, receive, send, tally)
                finally:
                    tracing.annotate(
                        span, **{"dedupe.outcome": tally.outcome, "http.route": tally.route}
                    )

    async def _answer(self, scope: Scope, receive: Receive, send: Send, tally: _Tally) -> None:
        """Serve a covered request and count its outcome."""
        try:
            tally.outcome, tally.route = await self._serve(scope, receive, send, tally)
        finally:
            self.metrics.http_answered(self._route_label(scope, tally.route), tally.outcome)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, tally: _Tally
    ) -> tuple[str, str | None]:
        """Answer a covered request; return its outcome and route (when known)."""
        headers = scope.get("headers", [])
        line = request_line(scope)
        body: bytes | None = None
        try:
            key = self.key_source.find(line, headers, None)
            if key is None and self.key_source.wants_body(headers):
                # The key may be in the body (a form's hidden field): read it to look.
                read = await read_body(scope, receive, self.max_body_bytes)
                if read is None:
                    return "refused", None  # the client went away before its body arrived
                if isinstance(read, Problem):
                    return await answer(send, read, "refused")
                body = read
                key = self.key_source.find(line, headers, body)
        except KeyRefused as exc:
            return await answer(send, bad_key(str(exc)), "refused")
        except SourceFailed as exc:
            return await _source_failed(send, line, exc)
        if key is None:
            if self.required:
                return await answer(send, key_required(), "refused")
            store = await self._store_or_problem()
            if isinstance(store, Problem):
                return await answer(send, store, "unavailable")
            state = scope.setdefault("state", {})
            db = Database(store.pool)
            state["idempotency"] = Idempotency(db=db, key=None, scope=None)
            tally.outcome = "unkeyed"  # also when the endpoint raises
            if body is not None:
                receive = _body_first(body, receive)
            return await run_unkeyed(self.app, scope, receive, send, db), None
        if self.secret is None and self.principal is not None:
            # No configured secret: the database's own is read when the pool opens.
            opened = await self._store_or_problem()
            if isinstance(opened, Problem):
                return await answer(send, opened, "unavailable")
        try:
            keyed = await read_keyed(
                scope,
                receive,
                key=key,
                body=body,
                app_name=self.dedupe_app.name,
                principal_source=self.principal,
                secret=self.secret,
                scheme=self.scheme,
                max_body_bytes=self.max_body_bytes,
            )
        except SourceFailed as exc:
            return await _source_failed(send, line, exc)
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
        if tally.traced:
            tracing.annotate_current(**{"dedupe.scope": request.scope, "dedupe.key": request.key})
        store = await self._store_or_problem()
        if isinstance(store, Problem):
            return await answer(send, store, "unavailable")
        if self._claims is None or self._leases is None:
            return await answer(send, db_down(), "unavailable")
        if self.one_transaction(str(scope["method"]), str(scope.get("path", ""))):
            found = await self._look_up(request) if self._read_first else None
            if found is not None and found.status is not None:
                # A committed row: counted here, as it never reaches the claim in one
                # transaction; a replay is answered, any other goes to the two-commit claim.
                self._read_first.saw(True)
                if found.replay:
                    duplicate = Duplicate("completed", found.result)
                    return await answer_for(send, request, duplicate, self._activity)
            else:  # no row seen: ours to claim in one
                ran = await self._in_one_transaction(
                    scope, receive, send, store, request, body, tally
                )
                if ran is not None:
                    return ran
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
            stores=self.stores,
        )
        run.effects = RunEffects(db, verdict.fence, cancel=run.lose)
        return await self._run(scope, receive, run, request, body, tally)

    async def _look_up(self, request: ClaimRequest) -> one_tx.Claimed | None:
        """The key's committed row, read in a statement shared by concurrent requests; None
        when the read failed (the claim finds out)."""
        assert self._look_ups is not None
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                return await self._look_ups.look_up(request)
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError, TimeoutError) as exc:
            logger.warning("key %s: reading its row failed: %r", request.key, exc)
            return None

    async def _in_one_transaction(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        store: ClaimStore,
        request: ClaimRequest,
        body: bytes,
        tally: _Tally,
    ) -> tuple[str, str | None] | None:
        """Claim, run and store in one transaction (dedupe.asgi.one_transaction); a replay is
        answered from the claim's read; None when the key has another committed row: the
        two-commit claim decides (nothing was written)."""
        assert self._leases is not None
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                conn = await store.pool.acquire()
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError, TimeoutError) as exc:
            logger.warning("key %s: no connection for the claim: %r", request.key, exc)
            return await answer(send, db_down(), "unavailable")
        db = one_tx.ClaimTransaction(store.pool, conn)
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):  # the lock wait is bounded below it
                claimed = await one_tx.claim(
                    db, request, self.bounds, owner=self.owner, retention_s=self.terms.retention_s
                )
            store.count_claims(1)  # (a young claims table is analyzed: ClaimStore)
        except asyncpg.LockNotAvailableError:
            await db.close()
            return await answer(send, in_flight(), "in_flight")  # held by a run still open
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError, TimeoutError) as exc:
            await db.close()
            logger.warning("key %s: claiming failed: %r", request.key, exc)
            return await answer(send, db_down(), "unavailable")
        except BaseException:
            await db.close()
            raise
        # Every request that reaches the claim is counted by its read (one_tx.ReadFirst); one
        # that a look-up found a row for ended before it and was counted there.
        self._read_first.saw(claimed.status is not None)
        if claimed.token is None:
            await db.close()
            if claimed.replay:  # answered from the claim's own read
                duplicate = Duplicate("completed", claimed.result)
                return await answer_for(send, request, duplicate, self._activity)
            return None
        fence = Fence(request.scope, request.key, claimed.token)
        run = one_tx.OneTransactionRun(
            app=self.app,
            store=store,
            leases=self._leases,
            fence=fence,
            attempt=1,
            retention_s=self.terms.retention_s,
            max_response_bytes=MAX_RESPONSE_BYTES,
            db=db,
            send=send,
            stores=self.stores,
            request=request,
            bounds=self.bounds,
        )
        run.effects = one_tx.effects(db, run)
        return await self._run(scope, receive, run, request, body, tally)

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        run: KeyedRun,
        request: ClaimRequest,
        body: bytes,
        tally: _Tally,
    ) -> tuple[str, str | None]:
        """Run the endpoint under its claim; count and log what it came to."""
        scope.setdefault("state", {})["idempotency"] = Idempotency(
            db=run.db,
            key=request.key,
            scope=request.scope,
            attempt=run.attempt,
            effects=run.effects,
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
            elif run.outcome == "not_stored" and run.status:
                logger.info(
                    "key %s: a %d is not stored (store_status=); its writes rolled back, the "
                    "key is released",
                    request.key,
                    run.status,
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

    async def _store_or_problem(self) -> ClaimStore | Problem:
        if self.store is not None:
            return self.store
        try:
            return await self.open()
        except StoreError as exc:
            logger.warning("the claims database is unreachable: %s", exc)
            return db_down()
        except SchemaMismatch as exc:
            logger.error("IdempotencyMiddleware answers 503 to keyed requests: %s", exc)
            return schema_refused()

    def _route_label(self, scope: Scope, route: str | None) -> str:
        label = route or getattr(scope.get("route"), "path", None) or str(scope.get("path", ""))
        if label in self._routes:
            return label
        if len(self._routes) >= MAX_ROUTE_LABELS:
            return "other"
        self._routes.add(label)
        return label


# -- helpers ---------------------------------------------------------------------------------


def _principal_secret(given: str | bytes | None, *, scoped: bool) -> bytes | None:
    """The HMAC key of the principals: principal_secret=, else DEDUPE_HTTP_SECRET; refused
    when short. None: no secret configured (with scope=, the database's own is used once the
    pool opens, see _database_secret)."""
    if given is None:
        given = os.environ.get(SECRET_ENV) or None
    if given is None:
        if scoped:
            logger.warning(
                "IdempotencyMiddleware: no principal_secret= or %s; the callers' credentials "
                "are hashed under a key derived from the PostgreSQL cluster's system identifier "
                "(a dump of the claims table alone cannot reverse them, a database user can). "
                "Set a random secret, the same in every process of the API: "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
                SECRET_ENV,
            )
        return None
    secret = given.encode("utf-8") if isinstance(given, str) else bytes(given)
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigurationError(
            f"IdempotencyMiddleware: principal_secret is {len(secret)} bytes; use a random one "
            f"of at least {MIN_SECRET_BYTES} (`python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`)"
        )
    return secret


async def _source_failed(
    send: Send, line: RequestLine, exc: SourceFailed
) -> tuple[str, str | None]:
    """A key= or scope= function raised: the request cannot be keyed (intake.option_failed)."""
    return await answer(send, option_failed(line, exc), "refused")


class _Tally:
    """What a request came to, for the metrics: set as it goes, read when it ends; and
    whether it runs in a recording SERVER span (asked of OpenTelemetry once per request)."""

    __slots__ = ("outcome", "route", "traced")

    def __init__(self, *, traced: bool = False) -> None:
        self.outcome = "refused"
        self.route: str | None = None
        self.traced = traced


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


async def _database_secret(pool: asyncpg.Pool) -> bytes:
    """The principals' HMAC key when none is configured: derived from the cluster's system
    identifier, which every process of the API reads alike (a streaming standby shares it)
    and which no dump of a table carries. A restore into another cluster is a new key space:
    a retry sent across it runs again once."""
    try:
        identifier = await pool.fetchval("SELECT system_identifier FROM pg_control_system()")
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise StoreError(f"cannot read the cluster's system identifier: {exc}") from exc
    return hashlib.sha256(b"dedupe-worker principal secret v1:" + str(identifier).encode()).digest()
