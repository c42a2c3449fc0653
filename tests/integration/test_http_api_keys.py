"""Where dedupe.asgi finds a request's key, on a real uvicorn and PostgreSQL: the workers' key
specs (`header:`, `body:` paths, chains) plus `form:NAME` for urlencoded and multipart bodies,
so an HTML form with a hidden key field is protected (handlers/orders_api.py's order form)."""

from __future__ import annotations

import logging
import re
from typing import Any

import asyncpg
import httpx
import pytest

from dedupe import App
from dedupe.asgi import IdempotencyMiddleware
from dedupe.errors import ConfigurationError
from tests.apps.http_api import create_test_api
from tests.integration.http_server import serving
from tests.integration.test_http_api import ALICE, client_of, orders

SESSION = {"Cookie": "session=browser-session-1"}


@pytest.fixture
async def api(orders_db: str) -> Any:
    async with serving(create_test_api(orders_db, wait_s=5)) as base, client_of(base) as client:
        yield client


def form(key: str | None, sku: str = "espresso-machine", quantity: int = 1) -> dict[str, str]:
    fields = {"sku": sku, "quantity": str(quantity)}
    if key is not None:
        fields["idempotency_key"] = key
    return fields


async def test_an_urlencoded_form_with_a_hidden_key_makes_one_order_and_replays_its_page(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """form:idempotency_key: the second submit of the same form gets the first one's page."""
    first = await api.post("/orders/form", data=form("f-1"), headers=SESSION)
    again = await api.post("/orders/form", data=form("f-1"), headers=SESSION)
    assert first.status_code == again.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content and "Order 1 placed" in first.text
    assert again.headers["content-type"].startswith("text/html")
    assert await orders(db) == [("espresso-machine", "f-1")]


async def test_a_multipart_form_is_the_same_request_under_another_boundary(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """A browser draws a new multipart boundary per submit: the fields decide, not the bytes."""
    fields = form("m-1")
    first = await api.post(
        "/orders/form", files={k: (None, v) for k, v in fields.items()}, headers=SESSION
    )
    again = await api.post(
        "/orders/form", files={k: (None, v) for k, v in fields.items()}, headers=SESSION
    )
    boundaries = {r.request.headers["content-type"] for r in (first, again)}
    assert len(boundaries) == 2  # two boundaries
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    other = await api.post(
        "/orders/form",
        files={k: (None, v) for k, v in form("m-1", quantity=2).items()},
        headers=SESSION,
    )
    assert other.status_code == 422
    assert await orders(db) == [("espresso-machine", "m-1")]


async def test_the_header_comes_first_in_the_chain_and_a_form_without_a_key_runs_unprotected(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """`header:Idempotency-Key|form:idempotency_key`: the header wins over the field; without
    either the form runs every time (and the endpoint still gets its whole body)."""
    by_header = await api.post(
        "/orders/form",
        data=form("field-key", sku="a"),
        headers={**SESSION, "Idempotency-Key": "header-key"},
    )
    free = [await api.post("/orders/form", data=form(None, sku="b"), headers=SESSION) for _ in "12"]
    assert by_header.status_code == 201 and all(f.status_code == 201 for f in free)
    assert "idempotent-replayed" not in free[1].headers
    assert await orders(db) == [("a", "header-key"), ("b", None), ("b", None)]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("idempotency_key=one&idempotency_key=two&sku=x", "not 2"),
        ("idempotency_key=&sku=x", "empty"),
        ("idempotency_key=caf%C3%A9&sku=x", "visible ASCII"),
        ("idempotency_key=" + "k" * 256 + "&sku=x", "256 characters"),
    ],
)
async def test_a_form_key_follows_the_keys_grammar(
    api: httpx.AsyncClient, db: asyncpg.Connection, body: str, why: str
) -> None:
    """The field's value is a key like the header's: 1-255 visible ASCII, one of it."""
    answer = await api.post(
        "/orders/form",
        content=body.encode(),
        headers={**SESSION, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == "urn:dedupe-worker:problem:invalid-key"
    assert (
        why in answer.json()["detail"] and "form field idempotency_key" in answer.json()["detail"]
    )
    assert await orders(db) == []


async def test_a_key_from_a_json_body_path(orders_db: str, db: asyncpg.Connection) -> None:
    """key="body:request.id": a JSON body carries its own key; a body without it runs
    unprotected; a body that is not JSON has no key there."""
    api = create_test_api(orders_db, key="body:request.id")
    async with serving(api) as base, client_of(base) as client:
        body = {"request": {"id": "b-7"}, "sku": "pen"}
        first = await client.post("/echo", json=body, headers=ALICE)
        again = await client.post("/echo", json=body, headers=ALICE)
        unkeyed = await client.post("/echo", json={"sku": "pen"}, headers=ALICE)
        header_only = await client.post(
            "/echo", content=b"plain", headers={**ALICE, "Idempotency-Key": "ignored"}
        )
    assert first.json()["key"] == "b-7" and again.headers["idempotent-replayed"] == "true"
    assert unkeyed.json()["key"] is None and header_only.json()["key"] is None
    assert len(await orders(db)) == 3


async def test_the_form_page_draws_a_new_key_per_render_and_a_session(
    api: httpx.AsyncClient,
) -> None:
    """GET /order-form: a hidden idempotency_key field, new on every render, and a session
    cookie that scopes the browser's keys."""
    pages = [await api.get("/order-form") for _ in "12"]
    keys = [re.search(r'name="idempotency_key" value="([^"]+)"', p.text) for p in pages]
    assert all(keys) and keys[0][1] != keys[1][1]  # type: ignore[index]
    assert "session=" in pages[0].headers["set-cookie"]
    assert "httponly" in pages[0].headers["set-cookie"].lower()


def _raising(message: Any) -> str | None:
    raise ValueError("this request breaks the function")


@pytest.mark.parametrize("option", ["key", "scope"])
async def test_a_key_or_scope_function_that_raises_is_a_400_and_the_endpoint_does_not_run(
    orders_db: str, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture, option: str
) -> None:
    """Nothing a client sends yields a 5xx: a key= or scope= callable that raises on the
    request answers 400 invalid-request (as a raising fingerprint= does), claims nothing, runs
    nothing, and logs the function's exception at WARNING for the API's owner."""
    api = create_test_api(orders_db, **{option: _raising})
    with caplog.at_level(logging.WARNING, logger="dedupe.asgi"):
        async with serving(api) as base, client_of(base) as client:
            answer = await client.post(
                "/echo", json={"sku": "pen"}, headers={**ALICE, "Idempotency-Key": "r-1"}
            )
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"] == "urn:dedupe-worker:problem:invalid-request"
    assert problem["detail"] == f"the {option}= function raised ValueError on this request"
    assert await orders(db) == []
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 0
    [record] = [r for r in caplog.records if r.name == "dedupe.asgi" and "raised" in r.message]
    assert record.levelno == logging.WARNING and f"{option}= function" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)


@pytest.mark.parametrize("spec", ["kafka:offset", "message_id", "form:", "cookie:x", "body:a..b"])
def test_a_key_spec_that_no_request_has_is_refused_at_start(spec: str) -> None:
    """Only the sources of an HTTP request: header:, form:, body:, chains or a callable."""
    with pytest.raises(ConfigurationError, match="key="):
        IdempotencyMiddleware(
            _nothing, dedupe_app=App("x"), database_url="postgresql://h/d", scope=None, key=spec
        )


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not served")
