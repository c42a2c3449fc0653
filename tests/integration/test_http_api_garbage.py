"""A keyed request through IdempotencyMiddleware leaves no reference cycle of dedupe's objects
behind: its run, effects, transaction and claim go by reference counting as the request ends,
not by the cyclic GC (whose collections a cycle per request made a few percent of a new key's
CPU; bench/http_core.py). The app is called in-process as an ASGI app, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.apps.http_api import create_test_api

BODY = json.dumps({"sku": "gc", "quantity": 1}).encode()


async def post(app: Any, key: str | None, path: str = "/orders") -> int:
    """One POST as a server passes it to the ASGI app; its status."""
    headers = [(b"authorization", b"Bearer gc"), (b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"idempotency-key", key.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }
    sent = False
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    return statuses[0]


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """The app's ASGI lifespan as a server runs it: the middleware's pools open at startup and
    close at shutdown."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    task = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put)
    )
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task


@contextlib.contextmanager
def saved_garbage() -> Iterator[list[Any]]:
    """What the cyclic GC finds unreachable from here to the block's end (kept, not freed):
    gc.garbage. Garbage made before is collected (and freed) first."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def ours(garbage: list[Any]) -> list[str]:
    """The objects of dedupe's own classes among the garbage."""
    return sorted(type(o).__qualname__ for o in garbage if type(o).__module__.startswith("dedupe."))


@pytest.mark.parametrize("one_transaction", [True, False], ids=["one transaction", "two commits"])
@pytest.mark.parametrize("path", ["/orders", "/answer/503"], ids=["stored", "given back"])
async def test_a_keyed_request_leaves_no_cycle_of_ours(
    orders_db: str, one_transaction: bool, path: str
) -> None:
    app = create_test_api(orders_db, one_transaction=one_transaction)
    async with lifespan(app):
        assert await post(app, "warm-" + uuid.uuid4().hex) == 201
        key = uuid.uuid4().hex
        with saved_garbage() as garbage:
            statuses = [await post(app, key, path), await post(app, key, path)]
            gc.collect()
            left = ours(garbage)
    assert statuses == ([201, 201] if path == "/orders" else [503, 503])
    assert left == []
