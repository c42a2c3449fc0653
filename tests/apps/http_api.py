"""The orders API of handlers/orders_api.py plus endpoints that misbehave on purpose, for the
tests of dedupe.asgi (in process and as a uvicorn subprocess: `--factory
tests.apps.http_api:from_environment`)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from handlers.orders_api import create_api

# The principals' HMAC key of the test API (a subprocess takes DEDUPE_HTTP_SECRET first).
TEST_SECRET = "test-only-principal-secret-6f1e"


async def _order(request: Request, sku: str) -> int:
    idempotency = request.state.idempotency
    return int(
        await idempotency.db.fetchval(
            "INSERT INTO orders (sku, quantity, idempotency_key) VALUES ($1, 1, $2) RETURNING id",
            sku,
            idempotency.key,
        )
    )


def create_test_api(database_url: str | None = None, **options: Any) -> FastAPI:
    options.setdefault("principal_secret", TEST_SECRET)
    api = create_api(database_url, **options)

    @api.post("/answer/{status}")
    async def answer(request: Request, status: int) -> Response:
        """Writes an order, then answers `status` with Retry-After and Location headers."""
        order_id = await _order(request, f"answer-{status}")
        return JSONResponse(
            {"order_id": order_id, "status": status},
            status_code=status,
            headers={"Retry-After": "7", "Location": f"/orders/{order_id}"},
        )

    @api.post("/echo", status_code=201)
    async def echo(request: Request) -> dict[str, Any]:
        """Writes an order named after the request's body length; answers with the key."""
        body = await request.body()
        order_id = await _order(request, f"echo-{len(body)}")
        return {"order_id": order_id, "key": request.state.idempotency.key}

    @api.post("/slow", status_code=201)
    async def slow(request: Request, s: float = 1.0, sku: str = "slow") -> dict[str, Any]:
        """Sleeps `s` after its insert, or X-Pause-S seconds when the request carries it
        (headers are not fingerprinted: the retry without it is the same request)."""
        order_id = await _order(request, sku)
        await asyncio.sleep(float(request.headers.get("x-pause-s", s)))
        return {"order_id": order_id}

    @api.post("/late", status_code=201)
    async def late(request: Request) -> Response:
        """Writes an order, sleeps X-Pause-S seconds, then answers X-Answer (default 201);
        headers are not fingerprinted, so requests that differ only in them are duplicates."""
        order_id = await _order(request, "late")
        await asyncio.sleep(float(request.headers.get("x-pause-s", "0")))
        status = int(request.headers.get("x-answer", "201"))
        return JSONResponse({"order_id": order_id}, status_code=status)

    @api.post("/fail")
    async def fail(request: Request) -> Response:
        await _order(request, "fail")
        return JSONResponse({"error": "the provider is down"}, status_code=503)

    @api.post("/boom")
    async def boom(request: Request) -> None:
        await _order(request, "boom")
        raise RuntimeError("the endpoint has a bug")

    @api.post("/big")
    async def big(request: Request, n: int = 2_000_000, write: bool = True) -> Response:
        if write:
            await _order(request, "big")
        return Response(b"x" * n, media_type="application/octet-stream")

    @api.post("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def chunks() -> Any:
            for i in range(3):
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @api.post("/flaky", status_code=201)
    async def flaky(request: Request) -> Any:
        attempt = request.state.idempotency.attempt
        order_id = await _order(request, "flaky")
        if attempt < 2:
            return JSONResponse({"error": "try again"}, status_code=503)
        return {"order_id": order_id, "attempt": attempt}

    @api.post("/state")
    async def state(request: Request) -> dict[str, Any]:
        idempotency = request.state.idempotency
        one = await idempotency.db.fetchval("SELECT 1")
        return {"key": idempotency.key, "attempt": idempotency.attempt, "db": one}

    @api.post("/usurped", status_code=201)
    async def usurped(request: Request) -> dict[str, Any]:
        """Writes an order, then changes its own claim's token (as a newer claim would): its
        fenced completion finds the key no longer its own."""
        idempotency = request.state.idempotency
        order_id = await _order(request, "usurped")
        await idempotency.db.execute(
            "UPDATE dedupe_claims SET token = token + 1000 WHERE scope = $1 AND key = $2",
            idempotency.scope,
            idempotency.key,
        )
        return {"order_id": order_id}

    @api.post("/ends-itself")
    async def ends_itself(request: Request) -> Response:
        """Writes an order, then ends its own transaction, which it must not do: X-End
        `commit()` (request.state.idempotency.db.commit()) or a statement (`COMMIT`,
        `ROLLBACK`) sent through it; then answers X-Answer (default 201)."""
        db = request.state.idempotency.db
        order_id = await _order(request, "ends-itself")
        end = request.headers.get("x-end", "")
        if end == "commit()":
            await db.commit()
        elif end:
            await db.execute(end)
        status = int(request.headers.get("x-answer", "201"))
        return JSONResponse({"order_id": order_id}, status_code=status)

    @api.post("/deallocates", status_code=201)
    async def deallocates(request: Request) -> dict[str, Any]:
        """Writes an order, then runs `DEALLOCATE <X-Deallocate>` on its own connection when
        the header is sent (ALL, or a statement's name it holds)."""
        db = request.state.idempotency.db
        order_id = await _order(request, "deallocates")
        name = request.headers.get("x-deallocate")
        if name == "ALL" or await db.fetchval(
            "SELECT count(*) FROM pg_prepared_statements WHERE name = $1", name
        ):
            await db.execute(f"DEALLOCATE {name}")
        return {"order_id": order_id}

    @api.post("/quoted", status_code=201)
    async def quoted(request: Request) -> Response:
        """Writes an order; answers text full of what SQL literals quote, in body and header."""
        order_id = await _order(request, "quoted")
        text = f"order {order_id}: it's \\ \\' '' $$ -- ; /* */ \\x00 é 東京 \U0001f600"
        return Response(
            json.dumps({"text": text}, ensure_ascii=False),
            status_code=201,
            media_type="application/json",
            headers={"Location": f"/orders/{order_id}?note=it's\\'a''quote"},
        )

    @api.post("/binary")
    async def binary(request: Request) -> Response:
        await _order(request, "binary")
        body = bytes(range(256)) + b"\x00\xff"
        return Response(body, status_code=202, media_type="application/x-thing")

    @api.post("/notify", status_code=201)
    async def notify(
        request: Request, write: bool = True, fail: bool = False, step: bool = True
    ) -> Any:
        """Publishes an e-mail through the outbox (after its insert, or alone), and a step
        (unless step=false)."""
        idempotency = request.state.idempotency
        order_id = await _order(request, "notify") if write else None
        checked = await idempotency.step("check", lambda: {"ok": True}) if step else None
        message_id = await idempotency.publish("emails", {"order_id": order_id})
        if fail:
            return JSONResponse({"error": "failed after publishing"}, status_code=503)
        return {"order_id": order_id, "message_id": message_id, "checked": checked}

    return api


def from_environment() -> FastAPI:
    """The test API for a subprocess: DEDUPE_DATABASE_URL, HTTP_API_LEASE_S, HTTP_API_SCOPE,
    DEDUPE_HTTP_SECRET, HTTP_API_ONE_TRANSACTION (1: one_transaction=True)."""
    scope = os.environ.get("HTTP_API_SCOPE", "header:Authorization")
    return create_test_api(
        lease_s=float(os.environ.get("HTTP_API_LEASE_S", "30")),
        scope=None if scope == "none" else scope,
        principal_secret=os.environ.get("DEDUPE_HTTP_SECRET") or TEST_SECRET,
        one_transaction=os.environ.get("HTTP_API_ONE_TRANSACTION") == "1",
    )
