"""An HTTP request run under its claim: the endpoint's response buffered, stored and committed
with its `request.state.idempotency.db` writes before the first byte goes out; a 5xx or an
exception rolled back and its key given back; leases heartbeated, a lost one cancels the run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from dedupe.asgi.problems import ASGIMessage, Problem, Send, in_flight, unavailable
from dedupe.asgi.replies import StoredResponse
from dedupe.claims.completion import Completion, complete_in_transaction
from dedupe.claims.leases import HeldLeases
from dedupe.claims.records import Fence
from dedupe.claims.store import ClaimStore
from dedupe.context import Database
from dedupe.effects import outbox
from dedupe.effects.run_effects import RunEffects

logger = logging.getLogger("dedupe.asgi")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Longest wait for one claims-table statement of a request (claim, completion, give-back).
STORE_TIMEOUT_S = 5.0
# Responses that are not buffered: they are meant to reach the client as they are produced.
STREAMED_TYPES = (b"text/event-stream",)
# Send extensions that hand the server a file instead of body messages: not buffered here.
UNBUFFERED_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend")


# -- leases ----------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Held:
    """A key whose endpoint is running here."""

    fence: Fence
    lease_s: float
    task: asyncio.Task[None] | None = None
    lost: bool = False
    completing: bool = False


class HttpLeases(HeldLeases[Held]):
    """The keys this process runs, extended together every lease_s / 3 in one statement."""

    log = logger  # a failed heartbeat is the middleware's to tell (docs/http-api.md)

    def __init__(self, store: ClaimStore, lease_s: float) -> None:
        super().__init__(store)
        self.lease_s = lease_s

    def hold(self, fence: Fence) -> Held:
        held = Held(fence, self.lease_s)
        self._held[fence.ident] = held
        return held

    async def beat_every(self) -> None:
        """beat() until cancelled."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self.beat()


# -- a keyed request -------------------------------------------------------------------------


@dataclass(slots=True)
class KeyedRun:
    """One endpoint run that owns its key, and what its response became (`outcome`)."""

    app: ASGIApp
    store: ClaimStore
    leases: HttpLeases
    fence: Fence
    attempt: int
    retention_s: float
    max_response_bytes: int
    db: Database
    send: Send
    # Whether an answer below 500 is stored (dedupe.asgi.replies.compile_store_status).
    stores: Callable[[int], bool] = lambda status: True
    effects: RunEffects | None = None  # request.state.idempotency's publishes and steps
    outcome: str = "released_on_error"
    route: str | None = None
    _held: Held | None = None
    _scope: Scope | None = None
    # buffering, then: settled (key given back), passthrough (a 5xx, a stream), done, refused
    _mode: str = "buffering"
    _status: int = 0
    _headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    _start: ASGIMessage | None = None
    _chunks: list[bytes] = field(default_factory=list)
    _size: int = 0

    async def __call__(self, scope: Scope, receive: Receive) -> None:
        """Run the endpoint; raise what it raised (after the key is given back)."""
        extensions = scope.get("extensions")
        if isinstance(extensions, dict) and any(e in extensions for e in UNBUFFERED_EXTENSIONS):
            scope["extensions"] = {
                k: v for k, v in extensions.items() if k not in UNBUFFERED_EXTENSIONS
            }
        self._scope = scope
        held = self._held = self._hold()
        try:
            try:
                cancelled, error = await self._endpoint(scope, receive)
            except asyncio.CancelledError:
                await asyncio.shield(self._settle_error())
                raise
            self.route = self.route or _route_path(scope)
            if cancelled and held.lost:
                # The heartbeat found the key taken over: it is someone else's now.
                await self.db.close()
                self.outcome = "lease_lost"
                if self._mode == "buffering":
                    await self._refuse(in_flight("this request lost its key to a newer one"))
                return
            if self._mode == "buffering" and await self._cut_off():
                return
            if self._mode == "buffering":
                # An exception, or an endpoint that never finished its response: the server
                # answers (a 500); nothing is kept and the client's retry runs again.
                await self._settle_error()
            if error is not None:
                try:
                    raise error
                finally:
                    # Its traceback holds this frame, and this frame held it: a cycle.
                    error = None
        finally:
            # A failed endpoint's task holds its error, whose traceback holds endpoint()'s
            # frame and through it this run: let go of the task (test_http_api_garbage.py).
            held.task = None
            try:
                self.leases.forget(held)
                await self.db.close()
            finally:
                # The run is over: the request's objects must go by reference counting, not
                # by the cyclic GC (tests/integration/test_http_api_garbage.py; its full
                # collections were the p99 at half load, BENCHMARKS.md). The effects outlive
                # the run as request.state.idempotency's, in the scope a server's request
                # cycle holds, and their cancel (run.lose) reached the run and its send, which
                # that cycle binds: end() lets go of it. The run lets go of the effects and the
                # scope as well; the transaction's block marks (-> effects -> the transaction)
                # go with its close, which drops them first.
                if self.effects is not None:
                    self.effects.end()
                self.effects = None
                self._scope = None

    # -- what a one-transaction run (dedupe.asgi.one_transaction) does otherwise ---------------

    def _hold(self) -> Held:
        """The key's lease, heartbeated while the endpoint runs."""
        return self.leases.hold(self.fence)

    async def _endpoint(self, scope: Scope, receive: Receive) -> tuple[bool, BaseException | None]:
        """Run the endpoint in a task of its own, so that a heartbeat that finds the key taken
        over (or a step, `lose`) can cancel it: (whether it was cancelled, what it raised)."""
        assert self._held is not None

        async def endpoint() -> None:
            await self.app(scope, receive, self._send)

        task = asyncio.create_task(endpoint(), name=f"dedupe-http {self.fence.key}")
        self._held.task = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        if task.cancelled():
            return True, None
        return False, task.exception()

    async def _cut_off(self) -> bool:
        """The endpoint ended without an answer: whether this run cut it off and answered for it
        (a two-commit run never cuts its endpoint off)."""
        return False

    def _in_transaction(self, completion: Completion) -> bool:
        """Whether the completion commits in the endpoint's transaction (else alone)."""
        return self.db.started or bool(completion.outbox)

    async def _complete_in_transaction(self, completion: Completion) -> bool:
        """Complete the claim in the endpoint's transaction and commit it (False: fenced)."""
        return await complete_in_transaction(self.store, self.db, completion)

    @property
    def status(self) -> int:
        """The endpoint's status (0 before it answered)."""
        return self._status

    def lose(self) -> None:
        """A step found the key taken over: cancel the endpoint as the heartbeat would."""
        if self._held is not None:
            self._held.lost = True
            if self._held.task is not None:
                self._held.task.cancel()

    # -- the endpoint's send ----------------------------------------------------------------

    async def _send(self, message: ASGIMessage) -> None:
        kind = message["type"]
        if self._mode in ("done", "refused"):
            return  # our answer went out already; the endpoint's later messages are dropped
        if self._mode == "passthrough":
            await self.send(message)
            return
        if kind == "http.response.start":
            self._start = message
            self._status = int(message["status"])
            self._headers = list(message.get("headers", ()))
            if self._status >= 500:
                await self._settle_error()
                self._mode = "passthrough"
                await self.send(message)
            elif not self._stored(self._status):
                # Not the endpoint's decision about the request (401, 429...): it is rolled
                # back like a 5xx and the key given back, so the client's retry runs again.
                await self._settle_error()
                self.outcome = "not_stored"
                self._mode = "passthrough"
                await self.send(message)
            elif any(
                name.lower() == b"content-type" and value.lower().startswith(STREAMED_TYPES)
                for name, value in self._headers
            ):
                await self._overflow("it is a stream", more_body=True)
            return
        if kind != "http.response.body":
            if self._start is None:  # not a response of the HTTP protocol: not ours to keep
                await self.send(message)
                return
            await self._overflow(f"the endpoint sent {kind}", more_body=True)
            if self._mode == "passthrough":
                await self.send(message)
            return
        chunk = bytes(message.get("body", b""))
        self._chunks.append(chunk)
        self._size += len(chunk)
        more_body = bool(message.get("more_body", False))
        if self._size > self.max_response_bytes:
            await self._overflow(f"it is over {self.max_response_bytes} bytes", more_body=more_body)
        elif not more_body:
            await self._finish()

    def _stored(self, status: int) -> bool:
        try:
            return bool(self.stores(status))
        except Exception:
            logger.exception("store_status=%r failed for %d: not stored", self.stores, status)
            return False

    async def _finish(self) -> None:
        """The whole response is here: store it with the writes, then send it."""
        body = b"".join(self._chunks)
        self.route = _route_path(self._scope)
        stored = StoredResponse.of(self._status, self._headers, body, route=self.route)
        if not await self._commit(stored):
            return
        self.outcome = "new"
        self._mode = "done"
        assert self._start is not None
        await self.send(self._start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _overflow(self, why: str, *, more_body: bool) -> None:
        """A response not kept whole. With writes, they commit with its status and headers;
        without, the key is given back (the retry runs again). Then it streams; `more_body`:
        whether the endpoint's last message so far said more follows."""
        assert self._start is not None
        self.route = _route_path(self._scope)
        if self.db.started or self._outgoing():
            stored = StoredResponse.of(
                self._status, self._headers, b"", route=self.route, body_kept=False
            )
            if not await self._commit(stored):
                return
            self.outcome = "new"
            logger.info(
                "key %s: the response is not kept (%s); its writes and status are",
                self.fence.key,
                why,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "new"},
            )
        else:
            await self._settle_error()
            self.outcome = "not_stored"
            logger.info(
                "key %s: the response is not kept (%s) and nothing was written: the key is "
                "released, a retry runs the endpoint again",
                self.fence.key,
                why,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "not_stored"},
            )
        self._mode = "passthrough"
        await self.send(self._start)
        chunks, self._chunks = self._chunks, []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            await self.send(
                {"type": "http.response.body", "body": chunk, "more_body": more_body or not last}
            )

    # -- outcomes ---------------------------------------------------------------------------

    def _outgoing(self) -> list[outbox.Outgoing]:
        return self.effects.outgoing if self.effects is not None else []

    async def _commit(self, stored: StoredResponse) -> bool:
        """Complete the claim fenced by our token, in the endpoint's transaction when it wrote;
        False (our own answer sent) when the key is no longer ours or the database failed."""
        assert self._held is not None
        self._held.completing = True
        completion = Completion(self.fence, stored.to_result(), self.retention_s, self._outgoing())
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                if self._in_transaction(completion):
                    # ctx.db ends here, committed or rolled back: a background task of the
                    # endpoint's after the answer gets no transaction.
                    completed = await self._complete_in_transaction(completion)
                else:
                    outcome = (self.fence, completion.result, self.retention_s)
                    completed = bool(await self.store.complete([outcome]))
        except Exception as exc:
            # StoreError, a driver error at COMMIT, our timeout: whether the commit happened
            # is unknown. A give-back finds a completed key and leaves it be (the retry gets
            # the replay); otherwise the retry runs again.
            logger.warning(
                "key %s: storing the response failed (%s: %s); the key is released",
                self.fence.key,
                exc.__class__.__name__,
                exc,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "unavailable"},
            )
            await self._settle_error()
            self.outcome = "unavailable"
            await self._refuse(unavailable("the response could not be stored; retry"))
            return False
        finally:
            self.leases.forget(self._held)
        if not completed:
            await self.db.close()
            self.outcome = "lease_lost"
            logger.warning(
                "key %s: taken over by another request while this one ran; its writes were "
                "rolled back",
                self.fence.key,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "lease_lost"},
            )
            await self._refuse(in_flight("this request lost its key to a newer one"))
            return False
        return True

    async def _settle_error(self) -> None:
        """Roll the writes back and give the key back (once), so the client's retry runs."""
        if self._held is None or self._held.lost or self._mode != "buffering":
            await self.db.close()
            return
        self._held.completing = True
        self.leases.forget(self._held)
        await self.db.close()
        self.outcome = "released_on_error"
        self._mode = "settled"
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                await self.store.give_back(self.fence, handed_back=True)
        except Exception as exc:
            logger.warning(
                "key %s: could not release it (%s: %s); its lease expires",
                self.fence.key,
                exc.__class__.__name__,
                exc,
                extra={"scope": self.fence.scope, "key": self.fence.key, "outcome": "not_released"},
            )

    async def _refuse(self, problem: Problem) -> None:
        self._mode = "refused"
        await problem.send(self.send)


def _route_path(scope: Scope | None) -> str | None:
    """The route template the framework matched (Starlette, FastAPI: scope["route"].path)."""
    path = getattr((scope or {}).get("route"), "path", None)
    return path if isinstance(path, str) else None


# -- a covered request without a key ---------------------------------------------------------


async def run_unkeyed(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, db: Database
) -> str:
    """Run the endpoint with a transaction of its own, committed as its answer (below 500)
    starts: before its first byte. Returns the outcome ("unkeyed", or "unavailable")."""
    outcome = "unkeyed"
    started = refused = False

    async def send_committed(message: ASGIMessage) -> None:
        nonlocal started, refused, outcome
        if refused:
            return
        if message["type"] == "http.response.start" and not started:
            started = True
            if int(message["status"]) < 500:
                try:
                    async with asyncio.timeout(STORE_TIMEOUT_S):
                        await db.commit()
                except Exception as exc:
                    logger.warning(
                        "%s %s: the endpoint's transaction failed to commit (%s: %s)",
                        scope.get("method"),
                        scope.get("path"),
                        exc.__class__.__name__,
                        exc,
                        extra={"outcome": "unavailable"},
                    )
                    await db.close()
                    refused, outcome = True, "unavailable"
                    await unavailable("the endpoint's writes could not be committed").send(send)
                    return
            await db.close()  # rolls back a 5xx's writes; later use raises
        await send(message)

    try:
        await app(scope, receive, send_committed)
    finally:
        await db.close()
    return outcome


__all__ = ["STORE_TIMEOUT_S", "HttpLeases", "KeyedRun", "run_unkeyed"]
