"""What dedupe.asgi stores, on a real uvicorn and PostgreSQL: Stripe's rule (401, 403, 408, 409,
425, 429 and 5xx are never stored; `store_status=` changes it), the headers a replay keeps,
`fingerprint=` for clients that re-serialise their JSON, the principal's keyed hash, and a 503
with Retry-After when the store fails or the database is down."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import socket
from typing import Any

import asyncpg
import pytest

from dedupe import App
from dedupe.asgi import IdempotencyMiddleware
from dedupe.errors import ConfigurationError
from tests.apps.http_api import TEST_SECRET, create_test_api
from tests.conftest import eventually
from tests.integration.http_server import serving
from tests.integration.test_http_api import ALICE, client_of, orders, post


async def claim_row(db: asyncpg.Connection) -> asyncpg.Record:
    return await db.fetchrow("SELECT status, attempts, error, result::text FROM dedupe_claims")


@pytest.mark.parametrize("status", [401, 403, 408, 409, 425, 429])
async def test_an_answer_that_says_nothing_about_the_request_is_not_stored_and_a_retry_runs(
    orders_db: str, db: asyncpg.Connection, status: int
) -> None:
    """Stripe's rule: its writes roll back, the key is given back, the retry runs again."""
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        first = await post(client, f"k-{status}", {}, f"/answer/{status}")
        again = await post(client, f"k-{status}", {}, f"/answer/{status}")
    assert first.status_code == again.status_code == status
    assert first.headers["retry-after"] == "7"  # the endpoint's own headers reach the client
    assert "idempotent-replayed" not in again.headers
    assert again.json()["order_id"] != first.json()["order_id"]  # it ran again
    assert await orders(db) == []  # and each run's writes rolled back
    row = await claim_row(db)
    assert (row["status"], row["attempts"], row["error"]) == ("in_progress", 2, "handed back")


async def test_other_4xx_answers_are_stored_and_replayed(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """A 404 or a 422 is what the endpoint decided: stored with its writes, replayed."""
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        first = await post(client, "k-404", {}, "/answer/404")
        again = await post(client, "k-404", {}, "/answer/404")
    assert first.status_code == again.status_code == 404
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert await orders(db) == [("answer-404", "k-404")]


async def test_store_status_as_a_set_names_the_statuses_never_stored(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """store_status={429}: a 401 is stored now, a 429 still is not, a 5xx never is."""
    api = create_test_api(orders_db, store_status={429})
    async with serving(api) as base, client_of(base) as client:
        answers = {
            status: [await post(client, f"s-{status}", {}, f"/answer/{status}") for _ in "12"]
            for status in (401, 429, 503)
        }
    assert answers[401][1].headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in answers[429][1].headers
    assert "idempotent-replayed" not in answers[503][1].headers
    assert await orders(db) == [("answer-401", "s-401")]


async def test_store_status_as_a_callable_decides_per_status(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """store_status=lambda s: s < 400: only successes and redirects are stored."""
    api = create_test_api(orders_db, store_status=lambda status: status < 400)
    async with serving(api) as base, client_of(base) as client:
        missing = [await post(client, "c-404", {}, "/answer/404") for _ in "12"]
        moved = [
            await post(client, "c-303", {}, "/answer/303", follow_redirects=False) for _ in "12"
        ]
    assert "idempotent-replayed" not in missing[1].headers
    assert moved[1].status_code == 303 and moved[1].headers["idempotent-replayed"] == "true"
    assert await orders(db) == [("answer-303", "c-303")]


@pytest.mark.parametrize("bad", ["429", {99}, {True}, [600]])
def test_store_status_must_be_statuses_or_a_callable(bad: Any) -> None:
    """A string, a non-status or a bool is refused at start with what to write."""
    with pytest.raises(ConfigurationError, match="store_status="):
        IdempotencyMiddleware(
            _nothing,
            dedupe_app=App("x"),
            database_url="postgresql://h/d",
            scope=None,
            store_status=bad,
        )


async def test_a_replay_keeps_location_retry_after_and_content_type(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """The headers a client acts on come back with the stored answer."""
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        first = await post(client, "h-1", {}, "/answer/202")
        again = await post(client, "h-1", {}, "/answer/202")
    assert again.headers["idempotent-replayed"] == "true"
    for name in ("location", "retry-after", "content-type"):
        assert again.headers[name] == first.headers[name], name
    assert again.headers["retry-after"] == "7"


# -- fingerprints ----------------------------------------------------------------------------


async def test_fingerprint_json_takes_a_reserialised_body_for_the_same_request(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """fingerprint="json": other key order and whitespace replay; another value is a 422."""
    async with (
        serving(create_test_api(orders_db, fingerprint="json")) as base,
        client_of(base) as client,
    ):
        headers = {**ALICE, "Idempotency-Key": "j-1", "Content-Type": "application/json"}
        first = await client.post("/orders", content=b'{"sku":"pen","quantity":2}', headers=headers)
        reserialised = await client.post(
            "/orders", content=b'{ "quantity": 2,\n  "sku": "pen" }', headers=headers
        )
        other = await client.post("/orders", content=b'{"sku":"pen","quantity":3}', headers=headers)
    assert first.status_code == reserialised.status_code == 201
    assert reserialised.headers["idempotent-replayed"] == "true"
    assert reserialised.content == first.content
    assert other.status_code == 422
    assert await orders(db) == [("pen", "j-1")]


async def test_raw_fingerprints_still_refuse_a_reserialised_body(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """The default compares the bytes: the re-serialised body is another request (422)."""
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        headers = {**ALICE, "Idempotency-Key": "r-1", "Content-Type": "application/json"}
        await client.post("/orders", content=b'{"sku":"pen"}', headers=headers)
        other = await client.post("/orders", content=b'{ "sku": "pen" }', headers=headers)
    assert other.status_code == 422


async def test_fingerprint_exclude_leaves_body_paths_out(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """fingerprint_exclude=("sent_at",): a retry stamped anew is the same request; the
    method, path and query still count."""
    api = create_test_api(orders_db, fingerprint="json", fingerprint_exclude=("sent_at",))
    async with serving(api) as base, client_of(base) as client:
        first = await post(client, "x-1", {"sku": "ink", "sent_at": "10:00:00"})
        later = await post(client, "x-1", {"sku": "ink", "sent_at": "10:00:05"})
        other_query = await post(client, "x-1", {"sku": "ink"}, params={"q": "1"})
    assert later.headers["idempotent-replayed"] == "true" and later.content == first.content
    assert other_query.status_code == 422
    assert await orders(db) == [("ink", "x-1")]


async def test_a_fingerprint_function_sees_the_request_as_a_message(
    orders_db: str, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """fingerprint=callable: its bytes stand for the body (here: only the sku counts). When it
    raises, the client gets a 400 and the API's owner a WARNING with the exception."""
    import json

    def sku_only(message: Any) -> bytes:
        return str(json.loads(message.body)["sku"]).encode()

    api = create_test_api(orders_db, fingerprint=sku_only)
    with caplog.at_level(logging.WARNING, logger="dedupe.asgi"):
        async with serving(api) as base, client_of(base) as client:
            first = await post(client, "f-1", {"sku": "cup", "quantity": 1})
            same_sku = await post(client, "f-1", {"sku": "cup", "quantity": 5})
            other = await post(client, "f-1", {"sku": "mug"})
            broken = await post(client, "f-2", None, content=b"not json")
    assert same_sku.headers["idempotent-replayed"] == "true" and same_sku.content == first.content
    assert other.status_code == 422
    assert broken.status_code == 400
    assert broken.json()["type"] == "urn:dedupe-worker:problem:invalid-request"
    [record] = [r for r in caplog.records if r.name == "dedupe.asgi" and "raised" in r.message]
    assert record.levelno == logging.WARNING
    assert "the fingerprint function raised JSONDecodeError" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)


# -- the principal's keyed hash --------------------------------------------------------------


async def test_a_basic_credential_is_stored_as_an_hmac_under_the_secret(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """The scope holds HMAC-SHA256(secret, credential), never its plain SHA-256 (which a
    dictionary of passwords reverses); another secret makes another scope."""
    basic = {"Authorization": "Basic YWxpY2U6aHVudGVyMg=="}  # alice:hunter2
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        assert (await post(client, "b-1", {"sku": "a"}, headers=basic)).status_code == 201
    other = create_test_api(orders_db, principal_secret="another-secret-of-this-api-0")
    async with serving(other) as base, client_of(base) as client:
        assert (await post(client, "b-1", {"sku": "a"}, headers=basic)).status_code == 201
    scopes = [r["scope"] for r in await db.fetch("SELECT scope FROM dedupe_claims ORDER BY 1")]
    credential = basic["Authorization"].encode()
    keyed = hmac.new(TEST_SECRET.encode(), credential, hashlib.sha256).hexdigest()
    assert f"shop.http/{keyed}" in scopes and len(set(scopes)) == 2
    plain = hashlib.sha256(credential).hexdigest()
    assert not any(plain in s for s in scopes)


def test_a_short_secret_is_refused_and_the_variable_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short secret is refused with what to use; DEDUPE_HTTP_SECRET is read when
    principal_secret= is not given; scope=None needs none."""
    monkeypatch.delenv("DEDUPE_HTTP_SECRET", raising=False)
    options: dict[str, Any] = {"dedupe_app": App("x"), "database_url": "postgresql://h/d"}
    with pytest.raises(ConfigurationError, match="at least 16"):
        IdempotencyMiddleware(_nothing, principal_secret="short", **options)
    assert IdempotencyMiddleware(_nothing, scope=None, **options).secret is None
    monkeypatch.setenv("DEDUPE_HTTP_SECRET", "from-the-environment-0123")
    assert IdempotencyMiddleware(_nothing, **options).secret == b"from-the-environment-0123"


async def test_without_a_secret_the_credential_is_keyed_by_the_clusters_own_and_a_warning_says_so(
    orders_db: str,
    db: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The middleware as the contract writes it (no secret) starts and serves; the credential
    is stored as an HMAC under a key derived from the cluster's system identifier, never as
    its plain SHA-256; the log says to configure a secret."""
    monkeypatch.delenv("DEDUPE_HTTP_SECRET", raising=False)
    basic = {"Authorization": "Basic YWxpY2U6aHVudGVyMg=="}  # alice:hunter2
    said: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = said.append  # type: ignore[method-assign]
    logging.getLogger("dedupe.asgi").addHandler(handler)
    try:
        # Starlette builds its middleware at the first request.
        api = create_test_api(orders_db, principal_secret=None)
        async with serving(api) as base, client_of(base) as client:
            first = await post(client, "n-1", {"sku": "a"}, headers=basic)
            again = await post(client, "n-1", {"sku": "a"}, headers=basic)
    finally:
        logging.getLogger("dedupe.asgi").removeHandler(handler)
    assert any("DEDUPE_HTTP_SECRET" in r.getMessage() for r in said)
    assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    identifier = await db.fetchval("SELECT system_identifier FROM pg_control_system()")
    derived = hashlib.sha256(b"dedupe-worker principal secret v1:" + str(identifier).encode())
    credential = basic["Authorization"].encode()
    keyed = hmac.new(derived.digest(), credential, hashlib.sha256).hexdigest()
    scopes = [r["scope"] for r in await db.fetch("SELECT scope FROM dedupe_claims")]
    assert scopes == [f"shop.http/{keyed}"]
    assert hashlib.sha256(credential).hexdigest() not in scopes[0]


# -- the store failing -----------------------------------------------------------------------


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the endpoint must not run")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends


async def test_a_database_that_is_down_answers_503_with_retry_after_and_runs_nothing() -> None:
    """The middleware on a port where no PostgreSQL listens: keyed and unkeyed requests get a
    503 problem with Retry-After, and the endpoint never runs (nothing to store it with)."""
    calls: list[str] = []

    async def endpoint(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ran"})

    url = f"postgresql://dedupe:dedupe@127.0.0.1:{closed_port()}/nowhere"
    asgi = IdempotencyMiddleware(endpoint, dedupe_app=App("down"), database_url=url, scope=None)
    async with serving(asgi) as base, client_of(base) as client:
        keyed = await client.post("/o", content=b"x", headers={"Idempotency-Key": "d-1"})
        unkeyed = await client.post("/o", content=b"x")
        read = await client.get("/o")
    for answer in (keyed, unkeyed):
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "5"
        assert answer.json()["type"] == "urn:dedupe-worker:problem:store-unavailable"
    assert read.status_code == 201  # what the middleware does not cover still works
    assert calls == ["/o"]


async def test_a_store_that_fails_at_the_commit_answers_503_and_keeps_nothing(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """The endpoint's transaction is cut (pg_terminate_backend on this test's own database)
    after its insert, while it pauses: 503 with Retry-After, no order and no stored answer;
    the retry runs."""
    async with serving(create_test_api(orders_db)) as base, client_of(base) as client:
        first = asyncio.ensure_future(
            post(client, "t-1", {}, "/slow", params={"s": 0}, headers={"X-Pause-S": "1.5"})
        )

        async def cut() -> int:
            return int(
                await db.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND state = 'idle in transaction' AND query LIKE 'INSERT INTO orders%'"
                )
            )

        await eventually(cut, timeout_s=10, interval_s=0.02)
        failed = await first
        assert failed.status_code == 503, failed.text
        assert failed.headers["retry-after"] == "5"
        assert failed.json()["type"] == "urn:dedupe-worker:problem:store-unavailable"
        assert await orders(db) == []
        assert (await claim_row(db))["status"] == "in_progress"
        retry = await post(client, "t-1", {}, "/slow", params={"s": 0})
    assert retry.status_code == 201, retry.text
    assert await orders(db) == [("slow", "t-1")]
