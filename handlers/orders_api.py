"""The orders API example (FastAPI): `POST /orders` creates one order per Idempotency-Key,
however often the client retries it, and answers 201 with its id every time.

    DEDUPE_DATABASE_URL=postgresql://... uvicorn --factory handlers.orders_api:create_api

The order is written through `request.state.idempotency.db`, so it commits in one transaction
with the stored response: a retry after a timeout, a double tap or a proxy's retry gets the
same 201 and body (`Idempotent-Replayed: true`), and a crash before the commit leaves neither.
Keys are scoped by the caller: its Authorization header, or for a browser its session cookie
(stored only as an HMAC under DEDUPE_HTTP_SECRET).

`GET /order-form` is the same order as an HTML form: its hidden `idempotency_key` field is drawn
when the page is rendered, so a double click on "Buy", a reload of the answer or Back and
submit again make one order and show its page again.
"""

from __future__ import annotations

import contextlib
import html
import http.cookies
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, Field

from dedupe import App
from dedupe.asgi import IdempotencyMiddleware
from dedupe.claims.keys import KeySpec
from dedupe.message import Message

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


# Where the middleware finds a request's key: the header an API client sends, or the hidden
# field of the order form.
KEY_SPEC = "header:Idempotency-Key|form:idempotency_key"
SESSION_COOKIE = "session"


def caller(message: Message) -> str | None:
    """Whose request it is: the Authorization header, else the browser's session cookie."""
    authorization = message.headers.get("authorization")
    if authorization:
        return authorization
    cookies = http.cookies.SimpleCookie()
    try:
        cookies.load(message.headers.get("cookie", ""))
    except http.cookies.CookieError:
        return None
    session = cookies.get(SESSION_COOKIE)
    return session.value if session is not None and session.value else None


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


FORM_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Order</title></head>
<body>
<h1>Order</h1>
<form method="post" action="/orders/form">
  <input type="hidden" name="idempotency_key" value="{key}">
  <label>Item <input name="sku" value="espresso-machine" required></label>
  <label>Quantity <input name="quantity" type="number" value="1" min="1" max="1000"></label>
  <button id="buy" type="submit">Buy</button>
</form>
</body></html>
"""

PLACED_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Order {order_id}</title></head>
<body><h1 id="placed">Order {order_id} placed</h1>
<p id="item">{quantity} &times; {sku}</p>
<p><a href="/order-form">Order something else</a></p>
</body></html>
"""


async def order_form(request: Request) -> HTMLResponse:
    """GET /order-form: the order as an HTML form, with a key drawn for this page."""
    page = HTMLResponse(FORM_PAGE.format(key=secrets.token_urlsafe(18)))
    if caller_of_request(request) is None:
        page.set_cookie(SESSION_COOKIE, secrets.token_urlsafe(18), httponly=True, samesite="lax")
    return page


def caller_of_request(request: Request) -> str | None:
    return request.headers.get("authorization") or request.cookies.get(SESSION_COOKIE) or None


async def submit_order_form(request: Request) -> Response:
    """POST /orders/form: the form's order; its answer page is stored and shown again to a
    second submit of the same form."""
    form = await request.form()
    try:
        order = Order(sku=str(form.get("sku", "")), quantity=int(str(form.get("quantity", "1"))))
    except ValueError:
        return HTMLResponse("<p>Invalid order: check the item and the quantity.</p>", 422)
    idempotency = request.state.idempotency
    order_id = await idempotency.db.fetchval(
        "INSERT INTO orders (sku, quantity, idempotency_key) VALUES ($1, $2, $3) RETURNING id",
        order.sku,
        order.quantity,
        idempotency.key,
    )
    page = PLACED_PAGE.format(
        order_id=order_id, sku=html.escape(order.sku), quantity=order.quantity
    )
    return HTMLResponse(page, status_code=201, headers={"Location": f"/orders/{order_id}"})


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
    scope: KeySpec | None = caller,
    required: bool = False,
    wait_s: float = 0.0,
    lease_s: float = 30.0,
    **middleware: Any,
) -> FastAPI:
    """The API on `database_url` (default: DEDUPE_DATABASE_URL, read now, not at import);
    the principals' HMAC secret from DEDUPE_HTTP_SECRET (or principal_secret=); other keyword
    options go to IdempotencyMiddleware."""
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
        **{"key": KEY_SPEC, **middleware},
    )
    api.post("/orders", status_code=201)(create_order)
    api.get("/order-form", response_class=HTMLResponse)(order_form)
    api.post("/orders/form", status_code=201)(submit_order_form)
    api.get("/orders/{order_id}")(read_order)
    return api


__all__ = ["KEY_SPEC", "SCHEMA", "Order", "app", "caller", "create_api", "setup"]
