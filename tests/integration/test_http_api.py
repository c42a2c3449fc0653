"""dedupe.asgi.IdempotencyMiddleware on a real uvicorn server and PostgreSQL: one order per key
under concurrency, replays byte for byte, conflicts, keys in flight, tenants, required keys."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import httpx
import pytest

from tests.apps.http_api import create_test_api
from tests.conftest import eventually
from tests.integration.http_server import serving

ALICE = {"Authorization": "Bearer alice-secret-token"}
BOB = {"Authorization": "Bearer bob-secret-token"}


@pytest.fixture
async def api(orders_db: str) -> AsyncIterator[httpx.AsyncClient]:
    """The test API (lease 30 s, no wait) and a client of it."""
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        yield client


def client_of(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, timeout=30, limits=httpx.Limits(max_connections=64))


async def orders(db: asyncpg.Connection) -> list[tuple[str, str | None]]:
    rows = await db.fetch("SELECT sku, idempotency_key FROM orders ORDER BY id")
    return [(row["sku"], row["idempotency_key"]) for row in rows]


def post(client: httpx.AsyncClient, key: str | None, body: Any, path: str = "/orders", **kw: Any):  # type: ignore[no-untyped-def]
    headers = {**ALICE, **kw.pop("headers", {})}
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(path, json=body, headers=headers, **kw)


async def test_twenty_five_identical_concurrent_requests_create_one_order(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """25 copies of one request at once (the duplicates wait): one row, 25 identical 201s."""
    async with serving(create_test_api(orders_db, wait_s=10)) as base, client_of(base) as client:
        answers = await asyncio.gather(
            *(post(client, "order-1", {"sku": "book"}) for _ in range(25))
        )
    assert [a.status_code for a in answers] == [201] * 25
    assert len({a.content for a in answers}) == 1
    assert (
        sorted(a.headers.get("idempotent-replayed", "-") for a in answers) == ["-"] + ["true"] * 24
    )
    assert await orders(db) == [("book", "order-1")]


async def test_concurrent_duplicates_without_a_wait_get_409_and_one_order(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Without wait_s, the copies that find the first one running get 409 with Retry-After."""
    answers = await asyncio.gather(
        *(post(api, "k-slow", {}, "/slow", params={"s": 0.5}) for _ in range(20))
    )
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(201) == 1 and statuses.count(409) == 19, statuses
    busy = next(a for a in answers if a.status_code == 409)
    assert busy.headers["retry-after"] == "1"
    assert busy.headers["content-type"] == "application/problem+json"
    assert busy.json()["type"] == "urn:dedupe-worker:problem:in-flight"
    assert await orders(db) == [("slow", "k-slow")]


async def test_a_finished_key_replays_its_answer_byte_for_byte_without_running_again(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Status, body, Content-Type and Location again, marked Idempotent-Replayed: true."""
    first = await post(api, "k-1", {"sku": "pen", "quantity": 2})
    again = await post(api, "k-1", {"sku": "pen", "quantity": 2})
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again.headers["content-type"] == first.headers["content-type"]
    assert (
        again.headers["location"]
        == first.headers["location"]
        == f"/orders/{first.json()['order_id']}"
    )
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    binary = await post(api, "k-bin", None, "/binary", content=b"raw")
    binary_again = await post(api, "k-bin", None, "/binary", content=b"raw")
    assert binary_again.content == binary.content == bytes(range(256)) + b"\x00\xff"
    assert binary_again.status_code == 202
    assert binary_again.headers["content-type"] == "application/x-thing"
    assert await orders(db) == [("pen", "k-1"), ("binary", "k-bin")]


async def test_the_same_key_for_another_request_is_a_422(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Another body, path or query under a used key: 422 problem+json, nothing runs."""
    assert (await post(api, "k-2", {"sku": "pen"})).status_code == 201
    other_body = await post(api, "k-2", {"sku": "ink"})
    other_query = await post(api, "k-2", {"sku": "pen"}, params={"x": "1"})
    other_path = await post(api, "k-2", {}, "/slow", params={"s": 0})
    for answer in (other_body, other_query, other_path):
        assert answer.status_code == 422, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["type"] == "urn:dedupe-worker:problem:key-conflict"
    assert await orders(db) == [("pen", "k-2")]


def claimed(db: asyncpg.Connection) -> Callable[[], Awaitable[bool]]:
    """Whether a request's key is claimed and its run under way (the test API's one key)."""

    async def check() -> bool:
        return bool(
            await db.fetchval("SELECT count(*) > 0 FROM dedupe_claims WHERE status = 'in_progress'")
        )

    return check


async def test_a_duplicate_that_waits_gets_the_first_answer_replayed(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """With wait_s, a copy sent while the first runs waits for it and replays its answer."""
    async with serving(create_test_api(orders_db, wait_s=5)) as base, client_of(base) as client:
        first = asyncio.ensure_future(post(client, "k-w", {}, "/slow", params={"s": 0.6}))
        await eventually(claimed(db))  # the first request runs: the copy meets its claim
        waited = await post(client, "k-w", {}, "/slow", params={"s": 0.6})
        first_answer = await first
    assert first_answer.status_code == waited.status_code == 201
    assert waited.content == first_answer.content
    assert waited.headers["idempotent-replayed"] == "true"
    assert await orders(db) == [("slow", "k-w")]


async def test_a_duplicate_that_waits_too_short_gets_409(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """A wait shorter than the first request's run ends in 409 with Retry-After."""
    async with serving(create_test_api(orders_db, wait_s=0.3)) as base, client_of(base) as client:
        first = asyncio.ensure_future(post(client, "k-w2", {}, "/slow", params={"s": 1.5}))
        await eventually(claimed(db))  # the first request runs: the copy meets its claim
        started = asyncio.get_running_loop().time()
        waited = await post(client, "k-w2", {}, "/slow", params={"s": 1.5})
        elapsed = asyncio.get_running_loop().time() - started
        assert (await first).status_code == 201
    assert waited.status_code == 409 and waited.headers["retry-after"] == "1"
    assert 0.2 < elapsed < 1.3
    assert await orders(db) == [("slow", "k-w2")]


async def test_two_callers_with_the_same_key_get_an_order_each(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Keys are scoped by the Authorization header: the same key is two keys for two callers."""
    alice = await post(api, "shared-key", {"sku": "a"})
    bob = await post(api, "shared-key", {"sku": "b"}, headers=BOB)
    alice_again = await post(api, "shared-key", {"sku": "a"})
    assert alice.status_code == bob.status_code == 201
    assert alice.json()["order_id"] != bob.json()["order_id"]
    assert alice_again.content == alice.content
    assert await orders(db) == [("a", "shared-key"), ("b", "shared-key")]
    scopes = [r["scope"] for r in await db.fetch("SELECT scope FROM dedupe_claims ORDER BY 1")]
    assert len(set(scopes)) == 2 and all(s.startswith("shop.http/") for s in scopes)


async def test_a_keyed_request_without_credentials_is_a_400(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """With scope= set, a key without a principal would be shared by every caller: 400."""
    answer = await api.post("/orders", json={"sku": "x"}, headers={"Idempotency-Key": "k-3"})
    assert answer.status_code == 400
    assert answer.json()["type"] == "urn:dedupe-worker:problem:missing-principal"
    assert await orders(db) == []


async def test_scope_none_scopes_keys_by_the_app_alone(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """scope=None: no credentials needed, one key space for the whole app (`shop.http`)."""
    async with serving(create_test_api(orders_db, scope=None)) as base, client_of(base) as client:
        first = await client.post("/orders", json={"sku": "x"}, headers={"Idempotency-Key": "k"})
        again = await client.post(
            "/orders", json={"sku": "x"}, headers={**BOB, "Idempotency-Key": "k"}
        )
    assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert await db.fetchval("SELECT scope FROM dedupe_claims") == "shop.http"


async def test_required_keys_refuse_a_request_without_one(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """required=True: a covered request without Idempotency-Key is a 400; GET passes."""
    async with (
        serving(create_test_api(orders_db, required=True)) as base,
        client_of(base) as client,
    ):
        refused = await client.post("/orders", json={"sku": "x"}, headers=ALICE)
        keyed = await client.post(
            "/orders", json={"sku": "x"}, headers={**ALICE, "Idempotency-Key": "k"}
        )
        read = await client.get(keyed.headers["location"])
    assert refused.status_code == 400
    assert refused.json()["type"] == "urn:dedupe-worker:problem:missing-key"
    assert keyed.status_code == 201 and read.status_code == 200
    assert await orders(db) == [("x", "k")]


async def test_a_request_without_a_key_runs_in_a_transaction_of_its_own(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Not required: no key, the endpoint runs every time; its db commits below 500 only."""
    one = await post(api, None, {"sku": "free"})
    two = await post(api, None, {"sku": "free"})
    state = await post(api, None, {}, "/state")
    failed = await post(api, None, {}, "/fail")
    assert one.status_code == two.status_code == 201 and one.content != two.content
    assert state.json() == {"key": None, "attempt": 1, "db": 1}
    assert failed.status_code == 503
    assert await orders(db) == [("free", None), ("free", None)]
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 0


async def test_an_endpoints_publish_commits_with_its_response_once_and_not_on_a_5xx(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """request.state.idempotency.publish is ctx.publish for an endpoint: one outbox row per key
    (a replay adds none), committed with the response, also without a db write; a 5xx stores
    nothing; step results are recorded under the request's key; a request without a key
    cannot publish."""
    first = await post(api, "n-1", {}, "/notify")
    again = await post(api, "n-1", {}, "/notify")
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert first.json()["checked"] == {"ok": True}
    only = await post(api, "n-2", {}, "/notify", params={"write": "false"})
    assert only.status_code == 201, only.text
    failed = await post(api, "n-3", {}, "/notify", params={"fail": "true"})
    assert failed.status_code == 503
    rows = await db.fetch("SELECT channel, message_id, body FROM dedupe_outbox ORDER BY id")
    assert [(r["channel"], r["message_id"]) for r in rows] == [
        ("emails", first.json()["message_id"]),
        ("emails", only.json()["message_id"]),
    ]
    assert first.json()["message_id"] != only.json()["message_id"]
    assert json.loads(bytes(rows[0]["body"])) == {"order_id": first.json()["order_id"]}
    assert await db.fetchval("SELECT count(*) FROM dedupe_steps") == 3  # n-3's step stays
    unkeyed = await post(api, None, {}, "/notify")
    assert unkeyed.status_code == 500
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 2
