"""The schema gate: dedupe.Worker, the webhook receiver and IdempotencyMiddleware check the
database's migrations at start and refuse one older or newer than this code's, or never
migrated, with an error that names `dedupe-worker migrate`. The version needed is read from
dedupe/sql/migrations, so these tests hold whatever the last migration is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn

import dedupe_rabbitmq as rabbitmq
from dedupe import App, Context, Worker
from dedupe.asgi import IdempotencyMiddleware
from dedupe.claims.database import migrate
from dedupe.errors import SchemaMismatch
from dedupe.sql import migrations
from dedupe.webhooks import github
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_receiver.application import create_receiver
from tests.integration.brokers import RabbitBroker
from tests.integration.http_server import QuietServer

LAST, BEFORE_LAST = migrations()[-1], migrations()[-2]
NEEDED = f"version {LAST[0]} ({LAST[0]:04d}_{LAST[1]})"


async def older(db_url: str) -> str:
    """The test's database as the migrations before the last one left it."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        await conn.close()
    await migrate(db_url, up_to=BEFORE_LAST[0])
    return db_url


async def newer(db_url: str) -> str:
    """The test's database as a newer dedupe-worker would leave it: one migration more."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(
            "INSERT INTO dedupe_migrations (version, name) VALUES ($1, 'from_a_newer_version')",
            LAST[0] + 1,
        )
    finally:
        await conn.close()
    return db_url


async def never_migrated(db_url: str) -> str:
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        await conn.close()
    return db_url


SCHEMAS = {"older": older, "newer": newer, "never migrated": never_migrated}
# What each refusal says, besides the command: which version it found, which it needs.
SAYS = {
    "older": [
        "older than this dedupe-worker",
        f"found version {BEFORE_LAST[0]} ({BEFORE_LAST[0]:04d}_{BEFORE_LAST[1]})",
        f"needs {NEEDED}",
        f"pending: {LAST[0]:04d}_{LAST[1]}",
    ],
    "newer": [
        "newer than this dedupe-worker",
        f"found version {LAST[0] + 1} ({LAST[0] + 1:04d}_from_a_newer_version)",
        f"needs {NEEDED}",
    ],
    "never migrated": ["was never migrated", f"needs schema {NEEDED}"],
}


def assert_says(text: str, schema: str) -> None:
    assert "`dedupe-worker migrate`" in text, text
    for words in SAYS[schema]:
        assert words in text, text
    assert "dedupe:dedupe@" not in text  # the URL is shown without its password


def gate_app(channel: str) -> App:
    app = App("gate")

    @app.handler(channel)
    async def work(payload: dict[str, Any], ctx: Context) -> None:
        await ctx.db.execute("SELECT 1")

    return app


@pytest.mark.parametrize("schema", list(SCHEMAS))
async def test_a_worker_refuses_a_database_at_another_schema_and_takes_no_message(
    schema: str, db_url: str, amqp_url: str, channel: str
) -> None:
    """`async with Worker(...)` raises SchemaMismatch before it consumes anything: the message
    published before stays on the queue, no claim is made."""
    url = await SCHEMAS[schema](db_url)
    await rabbitmq.publish(amqp_url, channel, [(b'{"n": 1}', {}, "k1")])
    with pytest.raises(SchemaMismatch) as refused:
        async with Worker(
            gate_app(channel), broker_url=amqp_url, database_url=url, connect_timeout_s=5
        ):
            await asyncio.sleep(1)  # a worker that started would take the message meanwhile
    assert_says(str(refused.value), schema)
    assert await RabbitBroker(amqp_url).backlog(channel) == 1
    conn = await asyncpg.connect(url)
    try:
        if await conn.fetchval("SELECT to_regclass('dedupe_claims') IS NOT NULL"):
            assert await conn.fetchval("SELECT count(*) FROM dedupe_claims") == 0
    finally:
        await conn.close()


@pytest.mark.parametrize("schema", list(SCHEMAS))
async def test_the_receiver_refuses_to_start_on_another_schema(
    schema: str, db_url: str, amqp_url: str
) -> None:
    """create_receiver(database_url=...): its lifespan raises the same error, before a
    webhook is taken."""
    url = await SCHEMAS[schema](db_url)
    hooks = App("gate-hooks")
    hooks.webhook("github", verify=github(secret="s" * 32), channel="t-gate-unused")
    receiver = create_receiver(
        hooks, database_url=url, publisher=lambda: RabbitMQPublisher(amqp_url)
    )
    with pytest.raises(SchemaMismatch) as refused:
        async with receiver.router.lifespan_context(receiver):
            pytest.fail("the receiver started")
    assert_says(str(refused.value), schema)


# -- IdempotencyMiddleware --------------------------------------------------------------------


async def endpoint(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app with a lifespan, answering 201 to every request."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"made"})


@contextlib.asynccontextmanager
async def uvicorn_serving(asgi: Any) -> AsyncIterator[tuple[QuietServer, Any]]:
    """A real uvicorn without the ASGI lifespan (as a server or framework that has none)."""
    config = uvicorn.Config(asgi, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = QuietServer(config)
    task = asyncio.create_task(server.serve(), name="test-uvicorn")
    try:
        yield server, task
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


@pytest.mark.parametrize("schema", list(SCHEMAS))
async def test_the_middleware_refuses_the_servers_startup_on_another_schema(
    schema: str, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With an ASGI lifespan, the server is told the startup failed, with the error (uvicorn
    logs it and exits: run in a process of its own, it would stop this one), and the app
    underneath is shut down again; the error is in the middleware's log too."""
    url = await SCHEMAS[schema](db_url)
    asgi = IdempotencyMiddleware(endpoint, dedupe_app=App("gate"), database_url=url, scope=None)
    to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    to_server: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await to_app.put({"type": "lifespan.startup"})
    caplog.set_level(logging.INFO, logger="dedupe.asgi")
    # What a server does: run the lifespan, read its answer to the startup.
    await asyncio.wait_for(asgi({"type": "lifespan"}, to_app.get, to_server.put), 15)
    answers = [to_server.get_nowait() for _ in range(to_server.qsize())]
    assert [a["type"] for a in answers] == ["lifespan.startup.failed"], answers
    assert answers[0]["message"].startswith("IdempotencyMiddleware: ")
    assert_says(answers[0]["message"], schema)
    assert asgi.store is None  # its pools were closed
    logged = [r for r in caplog.records if r.name == "dedupe.asgi"]
    assert logged and all(r.levelno == logging.ERROR for r in logged)
    assert_says(logged[0].getMessage(), schema)


async def test_without_a_lifespan_keyed_requests_get_a_503_the_log_names_migrate_and_it_heals(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No lifespan: each keyed request is a 503 `store-not-migrated` with an error logged
    that says the database was never migrated and what to run; once migrated, it is served."""
    url = await never_migrated(db_url)
    asgi = IdempotencyMiddleware(endpoint, dedupe_app=App("gate"), database_url=url, scope=None)
    caplog.set_level(logging.INFO, logger="dedupe.asgi")
    async with uvicorn_serving(asgi) as (server, task):
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            before = await http.post("/orders", content=b"x", headers={"Idempotency-Key": "a"})
            assert before.status_code == 503
            assert before.headers["retry-after"]
            assert "store-not-migrated" in before.json()["type"]
            assert "migrate" not in before.json()["detail"]  # the log says what to run
            errors = [r for r in caplog.records if r.name == "dedupe.asgi"]
            assert errors and errors[-1].levelno == logging.ERROR
            assert_says(errors[-1].getMessage(), "never migrated")

            await migrate(url)
            after = await http.post("/orders", content=b"x", headers={"Idempotency-Key": "a"})
            assert (after.status_code, after.content) == (201, b"made")
    await asgi.close()
