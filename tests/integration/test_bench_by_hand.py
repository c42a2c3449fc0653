"""bench.http_api.by_hand, the floor bench.http_core measures the middleware against: the
orders endpoint made idempotent by hand in one transaction. On a real PostgreSQL, through the
bench's own in-process ASGI calls: a new key makes one order, the same key again answers the
same body and makes none, and keys of concurrent requests each make exactly one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg

from bench import http_core


async def post(app: Any, state: dict[str, Any], key: str) -> tuple[int, bytes]:
    answer: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": http_core.BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"authorization", http_core.TOKEN),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(http_core.BODY)).encode()),
        (b"idempotency-key", key.encode()),
    ]
    scope = http_core.post_scope(state, "/orders", headers)
    await app(scope, receive, send)
    return answer["status"], answer["body"]


async def test_the_floor_endpoint_makes_one_order_per_key_and_replays_its_answer(
    db_url: str, db: asyncpg.Connection
) -> None:
    app = http_core.make_api("hand", db_url)
    async with http_core.Lifespan(app) as life:
        first = await post(app, life.state, "k-1")
        again = await post(app, life.state, "k-1")
        together = await asyncio.gather(
            *(post(app, life.state, f"k-{i % 4}") for i in range(2, 26))
        )
    assert first[0] == again[0] == 201
    assert again[1] == first[1]
    assert json.loads(first[1])["order_id"] == 1
    assert all(status == 201 for status, _ in together)
    per_key = await db.fetch(
        "SELECT idempotency_key, count(*) AS n FROM orders GROUP BY 1 ORDER BY 1"
    )
    assert [(r["idempotency_key"], r["n"]) for r in per_key] == [
        ("k-0", 1),
        ("k-1", 1),
        ("k-2", 1),
        ("k-3", 1),
    ]
    answers = {body for status, body in together if status == 201}
    assert len(answers) == 4  # one answer per key, the same for each of its requests
