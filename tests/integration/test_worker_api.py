"""dedupe.Worker, the in-process API: an app embedded in a user's own service runs on a real
broker and database for the length of an `async with` block and stops gracefully."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context, Worker
from dedupe.errors import ConfigurationError
from tests.conftest import eventually
from tests.integration.brokers import Broker


class Job(BaseModel):
    n: int


def effects_app(channel: str, *, delay_s: float = 0.0) -> App:
    app = App("embedded")

    @app.handler(channel)
    async def work(payload: Job, ctx: Context) -> None:
        await asyncio.sleep(delay_s)
        await ctx.db.execute("INSERT INTO effects VALUES ($1)", ctx.key)

    return app


async def test_an_embedded_worker_runs_each_key_once_and_stops_with_its_block(
    broker: Broker, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    """Messages published twice run once inside the block; leaving it stops the consumer."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    messages = [(json.dumps({"n": i}).encode(), {}, f"k{i}") for i in range(20) for _ in range(2)]
    await broker.publish(channel, messages)
    async with Worker(
        effects_app(channel),
        transport=broker.transport(),
        database_url=db_url,
        broker_url="amqp://ignored.invalid/",
        gc_interval_s=0,
    ) as worker:

        async def done() -> bool:
            return worker.stats.completed == 20 and worker.stats.duplicates == 20

        await eventually(done)
    assert await db.fetchval("SELECT count(DISTINCT key) FROM effects") == 20
    assert await db.fetchval("SELECT count(*) FROM effects") == 20
    assert await broker.backlog(channel) == 0


async def test_a_worker_finds_its_transport_by_the_broker_urls_scheme(
    channel: str, db_url: str, amqp_url: str, db: asyncpg.Connection
) -> None:
    """Without a transport given, the amqp:// URL names the RabbitMQ plugin; stop() ends wait()."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    async with Worker(effects_app(channel), broker_url=amqp_url, database_url=db_url) as worker:
        waiting = asyncio.create_task(worker.wait())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        worker.request_stop()
        await asyncio.wait_for(waiting, 5)


def slow_worker(broker: Broker, channel: str, database_url: str) -> Worker:
    """A worker whose handler runs far longer than its shutdown timeout (0.5 s)."""
    return Worker(
        effects_app(channel, delay_s=60),
        transport=broker.transport(),
        database_url=database_url,
        broker_url="amqp://ignored.invalid/",
        shutdown_timeout_s=0.5,
    )


def claimed(db: asyncpg.Connection) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(await db.fetchval("SELECT count(*) FROM dedupe_claims"))

    return check


async def test_stopping_is_bounded_by_the_shutdown_timeout(
    broker: Broker, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    """A handler far longer than shutdown_timeout_s: the block ends about then, the key is
    handed back (claimable at once by the next worker)."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    await broker.publish(channel, [(json.dumps({"n": 1}).encode(), {}, "slow")])
    worker = slow_worker(broker, channel, db_url)
    async with worker:
        await eventually(claimed(db))
        began = time.monotonic()
    assert time.monotonic() - began < 5
    row = await db.fetchrow("SELECT status, lease_until <= now() AS free FROM dedupe_claims")
    assert (row["status"], row["free"]) == ("in_progress", True)
    assert await db.fetchval("SELECT count(*) FROM effects") == 0


async def test_a_database_without_the_claims_table_is_a_clear_error(
    db_url: str, db: asyncpg.Connection, amqp_url: str
) -> None:
    """Entering the block on an unmigrated database says to run migrate."""
    await db.execute("DROP TABLE dedupe_claims CASCADE")
    with pytest.raises(ConfigurationError, match="dedupe-worker migrate"):
        async with Worker(App("x"), broker_url=amqp_url, database_url=db_url):
            pass


async def test_stopping_with_the_database_path_stalled_is_bounded(
    broker: Broker, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    """The path to PostgreSQL stalls (packets swallowed, connections left open) while a run is
    under way, and the worker is told to stop: it is done within its shutdown timeout plus the
    store's own bound, not when the network heals (before, it waited on the stalled
    connections' give-back and close for ever)."""
    from tests.chaos.proxy import FaultProxy

    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    await broker.publish(channel, [(json.dumps({"n": 1}).encode(), {}, "slow")])
    async with FaultProxy.of_url(db_url) as proxy:
        worker = slow_worker(broker, channel, proxy.url_for(db_url))
        async with worker:
            await eventually(claimed(db))
            proxy.stall()
            began = time.monotonic()
            try:
                async with asyncio.timeout(20):
                    await worker.stop()
            finally:
                proxy.resume()
        assert time.monotonic() - began < 0.5 + 12 + 5  # runs, grace, a margin
