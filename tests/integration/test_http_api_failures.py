"""dedupe.asgi when things go wrong, on a real uvicorn and PostgreSQL: 5xx and exceptions
release the key, bad keys are 400s, large and streamed responses, a lease taken over, the
metrics, a plain ASGI app, and that no credential reaches a table."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client import generate_latest

from dedupe import App
from dedupe.asgi import IdempotencyMiddleware
from dedupe.observability.metrics import Metrics
from tests.apps.http_api import create_test_api
from tests.integration.http_server import serving
from tests.integration.test_http_api import ALICE, client_of, orders, post

SECRET = "Bearer s3cr3t-credential-ZQX"


@pytest.fixture
async def api(orders_db: str) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        yield client


async def test_a_5xx_rolls_back_its_writes_and_releases_the_key_for_the_retry(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """The endpoint's 503 reaches the client, its order rolls back, the retry runs again."""
    first = await post(api, "k-fail", {}, "/fail")
    second = await post(api, "k-fail", {}, "/fail")
    assert first.status_code == second.status_code == 503
    assert first.json() == {"error": "the provider is down"}
    assert "idempotent-replayed" not in second.headers
    assert await orders(db) == []
    row = await db.fetchrow("SELECT status, attempts, error FROM dedupe_claims")
    assert row["status"] == "in_progress" and row["attempts"] == 2
    assert row["error"] == "handed back"


async def test_an_exception_rolls_back_and_releases_the_key(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """An endpoint that raises: the server's 500, nothing kept, the retry runs again."""
    first = await post(api, "k-boom", {}, "/boom")
    second = await post(api, "k-boom", {}, "/boom")
    assert first.status_code == second.status_code == 500
    assert "idempotent-replayed" not in second.headers
    assert await orders(db) == []
    assert await db.fetchval("SELECT attempts FROM dedupe_claims") == 2


async def test_a_released_key_runs_once_more_and_is_then_replayed(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """After a 5xx the same request may succeed (attempt 2); from then on it replays."""
    failed = await post(api, "k-r", {}, "/flaky")
    ok = await post(api, "k-r", {}, "/flaky")
    again = await post(api, "k-r", {}, "/flaky")
    assert failed.status_code == 503
    assert ok.status_code == 201 and ok.json()["attempt"] == 2
    assert again.content == ok.content and again.headers["idempotent-replayed"] == "true"
    assert await orders(db) == [("flaky", "k-r")]


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ([("Idempotency-Key", "")], "empty"),
        ([("Idempotency-Key", '""')], "empty"),
        ([("Idempotency-Key", "x" * 256)], "256 characters"),
        ([("Idempotency-Key", "a b")], "visible ASCII"),
        ([("Idempotency-Key", "caf\u00e9")], "visible ASCII"),
        ([("Idempotency-Key", '"unterminated')], "closing quote"),
        ([("Idempotency-Key", '"bad\\escape"')], "escapes"),
        ([("Idempotency-Key", "one"), ("Idempotency-Key", "two")], "not 2"),
    ],
)
async def test_a_malformed_key_is_a_400_and_runs_nothing(
    api: httpx.AsyncClient, db: asyncpg.Connection, headers: list[tuple[str, str]], why: str
) -> None:
    """Keys are one header of 1-255 visible ASCII characters; anything else is refused."""
    encoded = [(n.encode(), v.encode("latin-1")) for n, v in [*ALICE.items(), *headers]]
    answer = await api.post("/orders", json={"sku": "x"}, headers=encoded)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"] == "urn:dedupe-worker:problem:invalid-key"
    assert why in answer.json()["detail"]
    assert await orders(db) == []


async def test_a_quoted_key_is_the_same_key_unquoted_and_255_characters_are_allowed(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """`"abc"` (the IETF draft's structured-field string) and `abc` name one key."""
    quoted = await post(api, '"k-q\\"1"', {"sku": "q"})
    bare = await post(api, 'k-q"1', {"sku": "q"})
    longest = await post(api, "k" * 255, {"sku": "long"})
    assert quoted.status_code == 201 and bare.headers["idempotent-replayed"] == "true"
    assert longest.status_code == 201
    keys = {row["key"] for row in await db.fetch("SELECT key FROM dedupe_claims")}
    assert keys == {'k-q"1', "k" * 255}


async def test_get_passes_straight_through(api: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    """Uncovered methods are not claimed, even with a key."""
    created = await post(api, "k-get", {"sku": "g"})
    read = await api.get(created.headers["location"], headers={"Idempotency-Key": "k-get"})
    missing = await api.get("/orders/999999", headers={"Idempotency-Key": ""})
    assert read.status_code == 200 and read.json()["sku"] == "g"
    assert missing.status_code == 404
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 1


async def test_a_response_too_large_to_keep_commits_its_writes_and_replays_its_status(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Over 1 MiB with writes: sent whole, the order and the status kept, replayed bodiless."""
    first = await post(api, "k-big", None, "/big", params={"n": 2_000_000}, content=b"b")
    again = await post(api, "k-big", None, "/big", params={"n": 2_000_000}, content=b"b")
    assert first.status_code == 200 and first.content == b"x" * 2_000_000
    assert again.status_code == 200 and again.content == b""
    assert again.headers["idempotent-replayed"] == "true"
    assert await orders(db) == [("big", "k-big")]
    result = json.loads(await db.fetchval("SELECT result::text FROM dedupe_claims"))
    assert result["body_kept"] is False and result["body"] == ""


async def test_a_response_too_large_to_keep_without_writes_releases_the_key(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Over 1 MiB, nothing written: sent whole, not kept, the retry computes it again."""
    params = {"n": 1_500_000, "write": "false"}
    first = await post(api, "k-big2", None, "/big", params=params, content=b"b")
    again = await post(api, "k-big2", None, "/big", params=params, content=b"b")
    assert first.content == again.content == b"x" * 1_500_000
    assert "idempotent-replayed" not in again.headers
    row = await db.fetchrow("SELECT status, error FROM dedupe_claims")
    assert row["status"] == "in_progress" and row["error"] == "handed back"


async def test_a_streamed_response_is_not_buffered_nor_kept(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """text/event-stream goes out as it is produced; without writes its key is released."""
    first = await post(api, "k-sse", None, "/stream", content=b"s")
    again = await post(api, "k-sse", None, "/stream", content=b"s")
    assert first.text == again.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert "idempotent-replayed" not in again.headers


async def test_a_body_over_the_bound_is_a_413(orders_db: str, db: asyncpg.Connection) -> None:
    """A keyed request's body is read whole to fingerprint it, up to max_body_bytes."""
    asgi = create_test_api(orders_db)
    asgi.user_middleware[0].kwargs["max_body_bytes"] = 1000
    async with serving(asgi) as base, client_of(base) as client:
        refused = await post(client, "k-413", None, content=b"x" * 1001)
        fits = await post(client, "k-413b", {"sku": "s"})
    assert refused.status_code == 413 and fits.status_code == 201
    assert refused.json()["type"] == "urn:dedupe-worker:problem:payload-too-large"


async def test_a_request_whose_key_was_taken_over_writes_nothing(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """The first run's lease lapses (a stalled process), a retry takes the key over: only the
    retry's order exists and the first request gets a 409, its writes rolled back."""
    async with (
        serving(create_test_api(orders_db, lease_s=30)) as base,
        client_of(base) as client,
    ):
        first = asyncio.ensure_future(
            post(client, "k-lost", {}, "/slow", params={"s": 1.0, "sku": "zombie"})
        )
        for _ in range(100):
            if await db.fetchval("SELECT count(*) FROM dedupe_claims"):
                break
            await asyncio.sleep(0.02)
        # As if the first process had stalled past its lease: another takes the key over.
        await db.execute("UPDATE dedupe_claims SET lease_until = now() - interval '1 s'")
        second = await post(client, "k-lost", {}, "/slow", params={"s": 1.0, "sku": "zombie"})
        lost = await first
    assert second.status_code == 201
    assert lost.status_code == 409, lost.text
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
    assert await db.fetchval("SELECT attempts FROM dedupe_claims") == 2


async def test_outcomes_are_counted_by_route_template(orders_db: str) -> None:
    """dedupe_http_requests_total{route,outcome}: the route as the framework declares it."""
    metrics = Metrics()
    asgi = create_test_api(orders_db)
    asgi.user_middleware[0].kwargs["metrics"] = metrics
    async with serving(asgi) as base, client_of(base) as client:
        await post(client, "m-1", {"sku": "a"})
        await post(client, "m-1", {"sku": "a"})
        await post(client, "m-1", {"sku": "b"})
        await post(client, "m-2", {}, "/fail")
        await post(client, "m-3", {}, "/slow", params={"s": 0})
        await post(client, None, {"sku": "free"})
    text = generate_latest(metrics.registry).decode()
    for route, outcome in [
        ("/orders", "new"),
        ("/orders", "replayed"),
        ("/orders", "conflict"),
        ("/fail", "released_on_error"),
        ("/slow", "new"),
        ("/orders", "unkeyed"),
    ]:
        assert f'dedupe_http_requests_total{{outcome="{outcome}",route="{route}"}} 1.0' in text


async def plain_endpoint(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app (no framework): it writes through scope["state"]["idempotency"].db."""
    if scope["type"] == "lifespan":
        await receive()  # startup
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await send({"type": "lifespan.shutdown.complete"})
        return
    idempotency = scope["state"]["idempotency"]
    body = (await receive())["body"]
    order_id = await idempotency.db.fetchval(
        "INSERT INTO orders (sku, quantity) VALUES ($1, 1) RETURNING id", body.decode()
    )
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": str(order_id).encode()})


async def test_a_plain_asgi_app_is_served_the_same_way(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """No framework: the key, the transaction in scope["state"] and the replay all work."""
    asgi = IdempotencyMiddleware(
        plain_endpoint, dedupe_app=App("plain"), database_url=orders_db, scope=None
    )
    async with serving(asgi) as base, client_of(base) as client:
        first = await client.post("/x", content=b"sku-1", headers={"Idempotency-Key": "p"})
        again = await client.post("/x", content=b"sku-1", headers={"Idempotency-Key": "p"})
    assert first.status_code == again.status_code == 201 and first.content == again.content
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
    assert await db.fetchval("SELECT scope FROM dedupe_claims") == "plain.http"


async def test_no_credential_reaches_any_table(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """Every text column of every table holds no trace of the Authorization header."""
    headers = {"Authorization": SECRET}
    await post(api, "c-1", {"sku": "a"}, headers=headers)
    await post(api, "c-1", {"sku": "a"}, headers=headers)
    await post(api, "c-1", {"sku": "other"}, headers=headers)
    await post(api, "c-2", {}, "/fail", headers=headers)
    await post(api, "c-3", {}, "/boom", headers=headers)
    await asyncio.sleep(0.1)
    columns = await db.fetch(
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = 'public'"
    )
    needles = [SECRET, SECRET.split()[1], "s3cr3t"]
    searched = 0
    for row in columns:
        table, column = row["table_name"], row["column_name"]
        hits = await db.fetchval(
            f'SELECT count(*) FROM "{table}" WHERE "{column}"::text LIKE ANY($1::text[])',
            [f"%{needle}%" for needle in needles],
        )
        assert hits == 0, f"{table}.{column} holds the credential"
        searched += 1
    assert searched > 20


async def test_a_heartbeat_that_finds_the_key_taken_cancels_the_endpoint(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """Heartbeats every lease_s / 3; one that finds another token cancels the run at once."""
    async with (
        serving(create_test_api(orders_db, lease_s=0.6)) as base,
        client_of(base) as client,
    ):
        started = asyncio.get_running_loop().time()
        first = asyncio.ensure_future(post(client, "k-hb", {}, "/slow", params={"s": 5}))
        for _ in range(100):
            if await db.fetchval("SELECT count(*) FROM dedupe_claims"):
                break
            await asyncio.sleep(0.02)
        await db.execute("UPDATE dedupe_claims SET token = nextval('dedupe_claim_tokens')")
        lost = await first
        elapsed = asyncio.get_running_loop().time() - started
    assert lost.status_code == 409 and elapsed < 3
    assert await orders(db) == []


async def test_the_status_overview_counts_http_keys_replays_and_conflicts(
    orders_db: str, store: Any
) -> None:
    """The status page's overview lists `shop.http` with its replays and conflicts."""
    from dedupe.operations.claims import ClaimAdmin

    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        await post(client, "s-1", {"sku": "a"})
        await post(client, "s-1", {"sku": "a"})
        await post(client, "s-1", {"sku": "b"})
    # The counts are flushed at the lifespan's shutdown (and every 5 s while serving).
    [row] = [r for r in await ClaimAdmin(store).overview() if r["handler"] == "shop.http"]
    assert (row["completed"], row["duplicates"], row["conflicts"]) == (1, 1, 1)
