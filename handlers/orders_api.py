"""The orders API example (FastAPI): `POST /orders` creates one order per Idempotency-Key,
however often the client retries it, and answers 201 with its id every time.

    DEDUPE_DATABASE_URL=postgresql://... uvicorn --factory handlers.orders_api:create_api

The order is written through `request.state.idempotency.db`, so it commits in one transaction
with the stored response: a retry after a timeout, a double tap or a proxy's retry gets the
same 201 and body (`Idempotent-Replayed: true`), and a crash before the commit leaves neither.
Keys are scoped by the caller's Authorization header (stored as its SHA-256 only).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from dedupe import App
from dedupe.asgi import IdempotencyMiddleware
from dedupe.claims.keys import KeySpec

app = App("shop")

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sku             text        NOT NULL,
    quantity        integer     NOT NULL,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now()
);
"""


class Order(BaseModel):
    sku: str = Field(min_length=1, max_length=100)
    quantity: int = Field(default=1, gt=0, le=1000)


async def setup(database_url: str) -> None:
    """Create the orders table (the claims tables come from `dedupe-worker migrate`)."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()


async def create_order(order: Order, request: Request, response: Response) -> dict[str, Any]:
    """POST /orders: the insert commits with the stored 201, or not at all."""
    idempotency = request.state.idempotency
    order_id = await idempotency.db.fetchval(
        "INSERT INTO orders (sku, quantity, idempotency_key) VALUES ($1, $2, $3) RETURNING id",
        order.sku,
        order.quantity,
        idempotency.key,
    )
    response.headers["Location"] = f"/orders/{order_id}"
    return {"order_id": order_id, "sku": order.sku, "quantity": order.quantity}


async def read_order(order_id: int, request: Request) -> dict[str, Any]:
    """GET /orders/{id}: not covered by the middleware (GET is safe to repeat)."""
    pool: asyncpg.Pool = request.app.state.pool
    row = await pool.fetchrow("SELECT id, sku, quantity FROM orders WHERE id = $1", order_id)
    if row is None:
        raise HTTPException(404, f"no order {order_id}")
    return {"order_id": row["id"], "sku": row["sku"], "quantity": row["quantity"]}


async def invalid_request(request: Request, exc: Exception) -> Response:
    """422 problem+json naming the fields, never echoing the input (FastAPI's own handler
    fails with a 500 on a body that is not UTF-8)."""
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": [str(part) for part in error.get("loc", ())], "msg": str(error.get("msg", ""))}
        for error in exc.errors()
    ]
    document = {
        "type": "urn:dedupe-worker:problem:invalid-order",
        "title": "Invalid order",
        "status": 422,
        "errors": errors,
    }
    return JSONResponse(document, status_code=422, media_type="application/problem+json")


def create_api(
    database_url: str | None = None,
    *,
    scope: KeySpec | None = "header:Authorization",
    required: bool = False,
    wait_s: float = 0.0,
    lease_s: float = 30.0,
) -> FastAPI:
    """The API on `database_url` (default: DEDUPE_DATABASE_URL, read now, not at import)."""
    url = database_url or os.environ.get("DEDUPE_DATABASE_URL")
    if not url:
        raise RuntimeError("set DEDUPE_DATABASE_URL to the PostgreSQL of the orders and claims")

    @contextlib.asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        await setup(url)
        async with asyncpg.create_pool(url, min_size=1, max_size=4) as pool:
            api.state.pool = pool
            yield

    api = FastAPI(title="orders", lifespan=lifespan)
    api.add_exception_handler(RequestValidationError, invalid_request)
    api.add_middleware(
        IdempotencyMiddleware,
        dedupe_app=app,
        database_url=url,
        scope=scope,
        required=required,
        wait_s=wait_s,
        lease_s=lease_s,
    )
    api.post("/orders", status_code=201)(create_order)
    api.get("/orders/{order_id}")(read_order)
    return api


__all__ = ["SCHEMA", "Order", "app", "create_api", "setup"]
