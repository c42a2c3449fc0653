"""The claims protocol's one-transaction path for a new key, written straight (bench.http_core's
`floor` mode): what a request of IdempotencyMiddleware(one_transaction=True) must do, with none
of the middleware's generality. Not a product path and not safe to serve: no replay, conflict,
5xx, stream, bound, outbox, metrics or tracing; a key found stored is answered 409 (one held by
an open transaction: an error after lock_timeout), repeated or upper-case key headers are not
refused. It measures how far a leaner implementation of the same protocol could go: the key
and principal read, the fingerprint, the bounded BEGIN and the claim in one round trip (the
middleware's own `claim`, dedupe.asgi.one_transaction), the endpoint with its writes on the
claim's connection, the response buffered and stored with the fenced completion and the
COMMIT in one round trip.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from dedupe.asgi.keys import RequestLine, checked_key, fingerprint, principal_hash
from dedupe.asgi.one_transaction import ClaimTransaction, claim
from dedupe.asgi.replies import StoredResponse
from dedupe.asgi.state import Idempotency
from dedupe.claims.completion import SESSION_TOKEN, Completion
from dedupe.claims.database import TransactionBounds, connect_pool
from dedupe.claims.records import ClaimRequest, Fence

OWNER = "floor@bench"


class ProtocolFloor:
    """ASGI middleware: the protocol's new-key path only (see the module)."""

    def __init__(self, app: Any, *, database_url: str, secret: bytes, app_name: str) -> None:
        self.app, self.url, self.secret = app, database_url, secret
        self.base = f"{app_name}.http"
        self.bounds = TransactionBounds.of(30.0)
        self.pool: asyncpg.Pool | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            if self.pool is None:
                self.pool = await connect_pool(self.url, max_size=20)
            await self.app(scope, receive, send)  # returns after the shutdown
            await self.pool.close()
            self.pool = None
            return
        headers = scope["headers"]
        key = auth = None
        for name, value in headers:
            if name == b"idempotency-key":
                key = checked_key(value, "Idempotency-Key")
            elif name == b"authorization":
                auth = value.decode("latin-1")
        message = await receive()
        body = message.get("body", b"")
        line = RequestLine(scope["method"], scope["raw_path"], scope["query_string"])
        claim_scope = f"{self.base}/{principal_hash(auth or '', self.secret)}"
        assert self.pool is not None and key is not None
        conn = await self.pool.acquire()
        db = ClaimTransaction(self.pool, conn)
        try:
            request = ClaimRequest(claim_scope, key, fingerprint(line, body))
            claimed = await claim(db, request, self.bounds, owner=OWNER, retention_s=86400.0)
            if claimed.token is None:
                await send({"type": "http.response.start", "status": 409, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            scope.setdefault("state", {})["idempotency"] = Idempotency(
                db=db, key=key, scope=claim_scope
            )
            start: dict[str, Any] = {}
            chunks: list[bytes] = []

            async def buffered(out: dict[str, Any]) -> None:
                if out["type"] == "http.response.start":
                    start.update(out)
                else:
                    chunks.append(out.get("body", b""))

            sent = False

            async def first_receive() -> Any:
                nonlocal sent
                if not sent:
                    sent = True
                    return message
                return await receive()

            await self.app(scope, first_receive, buffered)
            response = b"".join(chunks)
            stored = StoredResponse.of(
                start["status"], list(start["headers"]), response, route=None
            )
            fence = Fence(claim_scope, key, SESSION_TOKEN)
            assert await db.complete_and_commit(Completion(fence, stored.to_result(), 86400.0))
        finally:
            await db.close()
        await send(start)
        await send({"type": "http.response.body", "body": response})
