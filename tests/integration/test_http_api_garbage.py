"""A keyed request through IdempotencyMiddleware leaves no reference cycle of dedupe's objects
behind: its run, effects, transaction and claim go by reference counting as the request ends,
not by the cyclic GC (whose collections a cycle per request made a few percent of a new key's
CPU, bench/http_core.py, and, through uvicorn, whose full collections of the requests' graphs
were the p99 at half load, bench/http_api.py). The app is called in-process as an ASGI app,
and served by a real uvicorn in the test's loop, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import gc
import uuid

import httpx
import pytest

from bench import http_core
from tests.apps.http_api import create_test_api
from tests.garbage import ours, saved_garbage
from tests.in_process import BODY, post
from tests.integration.http_server import serving

KEY = "Idempotency-Key"


@pytest.mark.parametrize("one_transaction", [True, False], ids=["one transaction", "two commits"])
@pytest.mark.parametrize("path", ["/orders", "/answer/503"], ids=["stored", "given back"])
async def test_a_keyed_request_leaves_no_cycle_of_ours(
    orders_db: str, one_transaction: bool, path: str
) -> None:
    app = create_test_api(orders_db, one_transaction=one_transaction)
    async with http_core.Lifespan(app) as life:  # the pools open at startup, close at shutdown
        assert await post(app, life.state, "warm-" + uuid.uuid4().hex, "/orders") == 201
        key = uuid.uuid4().hex
        with saved_garbage() as garbage:
            statuses = [await post(app, life.state, key, path) for _ in range(2)]
            gc.collect()
            left = ours(garbage)
    assert statuses == ([201, 201] if path == "/orders" else [503, 503])
    assert left == []


@pytest.mark.parametrize("one_transaction", [True, False], ids=["one transaction", "two commits"])
@pytest.mark.parametrize(
    "path", ["/orders", "/answer/503", "/boom"], ids=["stored", "given back", "endpoint raised"]
)
async def test_a_request_served_by_uvicorn_leaves_no_cycle(
    orders_db: str, one_transaction: bool, path: str
) -> None:
    """As above through a real server, whose request cycle holds the scope and binds the `send`
    the run keeps: scope -> request.state.idempotency -> its effects -> the run -> send -> the
    server's request cycle -> the scope was a cycle per request (the request's whole graph,
    FastAPI's and uvicorn's objects too, left to the cyclic GC: its full collections, tens of
    ms, were the p99 at half load). Replays and unkeyed requests too; and an endpoint that
    raised (a 500), whose error the run kept: its traceback holds the endpoint's frame, which
    holds the run."""
    app = create_test_api(orders_db, one_transaction=one_transaction)
    key = uuid.uuid4().hex
    headers = {"Authorization": "Bearer garbage", "Content-Type": "application/json"}
    async with serving(app) as base, httpx.AsyncClient(base_url=base) as client:
        warm = await client.post("/orders", content=BODY, headers={**headers, KEY: "warm-" + key})
        assert warm.status_code == 201
        with saved_garbage() as garbage:
            statuses = [
                (await client.post(path, content=BODY, headers={**headers, KEY: key})).status_code
                for _ in range(2)
            ]
            unkeyed = await client.post("/orders", content=BODY, headers=headers)
            # The server's task of the last request may still be ending after its answer went
            # out (it runs in this loop): let it end, or its live objects would not be garbage.
            await asyncio.sleep(0.2)
            gc.collect()
            left = ours(garbage)
            cycles = sorted(
                type(o).__qualname__ for o in garbage if type(o).__module__.startswith("uvicorn.")
            )
    assert statuses == {"/orders": [201, 201], "/answer/503": [503, 503], "/boom": [500, 500]}[path]
    assert unkeyed.status_code == 201
    assert left == []
    assert cycles == []
