"""A keyed request through IdempotencyMiddleware leaves no reference cycle of dedupe's objects
behind: its run, effects, transaction and claim go by reference counting as the request ends,
not by the cyclic GC (whose collections a cycle per request made a few percent of a new key's
CPU; bench/http_core.py). The app is called in-process as an ASGI app, on a real PostgreSQL."""

from __future__ import annotations

import gc
import uuid

import pytest

from bench import http_core
from tests.apps.http_api import create_test_api
from tests.garbage import ours, saved_garbage
from tests.in_process import post


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
