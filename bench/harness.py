"""What every benchmark scenario stands on: a fresh database, a backlog published to RabbitMQ or
Kafka, a bench/worker.py process timed through it (`backlog_run`). Only 127.0.0.1 services."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg

from bench.apps import PUBLISHING, out_channel
from bench.baselines import NAIVE_TABLE
from dedupe.claims.database import migrate
from dedupe.testing.databases import drop_forced

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = os.environ.get(
    "DEDUPE_DATABASE_URL", "postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe"
)
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
KAFKA_URL = os.environ.get("BENCH_KAFKA_URL", "kafka://127.0.0.1:9092")
RUN = uuid.uuid4().hex[:8]
# Keys every fresh database holds already, analyzed: the steady state of a deployment (its claims
# table days deep, its statistics current) rather than a brand-new table, whose first cached
# plans, made while it held a few rows, scan it whole until autovacuum's first ANALYZE
# (BENCHMARKS.md, "A fresh table's first minute"). The naive consumer's table gets as many.
SEED_ROWS = int(os.environ.get("BENCH_SEED_ROWS", "100000"))
SEED_SCOPE = "bench.seed"


def db_url(name: str) -> str:
    return f"{ADMIN_URL.rpartition('/')[0]}/{name}"


async def seed(conn: asyncpg.Connection, rows: int, *, naive: bool = True) -> None:
    """`rows` completed claims of a scope no bench handler uses (kept 30 days), as many keys in
    the naive consumer's table (`naive`), then ANALYZE."""
    await conn.execute(
        "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, result, expires_at)"
        " SELECT $2, 'seed-' || g, '\\x00', 'completed', 'seed', 'null',"
        " now() + interval '30 days' FROM generate_series(1, $1) g",
        rows,
        SEED_SCOPE,
    )
    if naive:
        await conn.execute(
            "INSERT INTO bench_processed (key) SELECT 'seed-' || g FROM generate_series(1, $1) g",
            rows,
        )
    await conn.execute("ANALYZE")


@contextlib.asynccontextmanager
async def fresh_database() -> AsyncIterator[str]:
    """A migrated database with the handlers' tables, dropped afterwards."""
    name = f"bench_{RUN}_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(ADMIN_URL)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    url = db_url(name)
    try:
        await migrate(url)
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("CREATE TABLE bench_rows (id text PRIMARY KEY);" + NAIVE_TABLE)
            if SEED_ROWS:
                await seed(conn, SEED_ROWS)
        finally:
            await conn.close()
        yield url
    finally:
        admin = await asyncpg.connect(ADMIN_URL)
        try:
            # Retried while an autovacuum worker is in it (PostgreSQL refuses to end it for us).
            await drop_forced(admin, name)
        finally:
            await admin.close()


def body(i: int) -> bytes:
    return b'{"n": %d, "pad": "................................"}' % i


# -- brokers --------------------------------------------------------------------------------


async def rabbit_publish(queue: str, ids: list[str]) -> None:
    from dedupe_rabbitmq.admin import publish

    await publish(AMQP_URL, queue, [(body(i), {}, mid) for i, mid in enumerate(ids)])


async def rabbit_delete(queues: list[str]) -> None:
    from dedupe_rabbitmq.admin import delete_channels

    with contextlib.suppress(Exception):
        await delete_channels(AMQP_URL, queues)


async def kafka_publish(topic: str, ids: list[str]) -> None:
    from aiokafka import AIOKafkaProducer

    from dedupe.transport import dlq_name
    from dedupe_kafka import KafkaOptions, ensure_topics

    options = KafkaOptions.from_url(KAFKA_URL)
    await ensure_topics(options, [topic, dlq_name(topic)])
    producer = AIOKafkaProducer(
        bootstrap_servers=options.bootstrap_servers, acks="all", linger_ms=5
    )
    await producer.start()
    try:
        for start in range(0, len(ids), 5000):
            futures = [
                await producer.send(
                    topic,
                    body(i),
                    key=mid.encode(),
                    headers=[("message-id", mid.encode())],
                )
                for i, mid in enumerate(ids[start : start + 5000], start)
            ]
            await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def kafka_delete(topics: list[str]) -> None:
    from dedupe_kafka import delete_channels

    with contextlib.suppress(Exception):
        await delete_channels(KAFKA_URL, topics)


# -- running workers ------------------------------------------------------------------------


class Worker:
    """A bench/worker.py process; `result()` waits for its JSON line."""

    def __init__(self, kind: str, channel: str, db: str, **opts: Any) -> None:
        cmd = [sys.executable, "-m", "bench.worker", kind, "--channel", channel, "--db", db]
        for name, value in opts.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value not in (None, False):
                cmd += [flag, str(value)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)

    async def ready(self, timeout_s: float = 60) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        if "READY" not in line:
            raise RuntimeError(f"worker did not start: {line!r}")

    async def result(self, timeout_s: float = 900) -> dict[str, Any]:
        out, _ = await asyncio.wait_for(asyncio.to_thread(self.proc.communicate), timeout_s)
        lines = [x for x in out.splitlines() if x.startswith("{")]
        if not lines:
            raise RuntimeError(f"worker gave no result (exit {self.proc.returncode})")
        return dict(json.loads(lines[-1]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    async def exited(self, timeout_s: float) -> bool:
        """Whether the process ends by itself (its --n reached) within timeout_s."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.proc.wait, timeout_s)
        return self.proc.poll() is not None


def rate(result: dict[str, Any]) -> float:
    span = (result["last"] or 0) - (result["first"] or 0)
    return result["count"] / span if span > 0 else 0.0


def broker_of(kind: str) -> str:
    return KAFKA_URL if kind.startswith("kafka") else AMQP_URL


async def backlog_run(
    kind: str,
    n: int,
    handler: str,
    *,
    db: str | None = None,
    ids: list[str] | None = None,
    **opts: Any,
) -> dict[str, Any]:
    """Publish n messages, then time one worker of `kind` through them."""
    channel = f"bench-{RUN}-{kind}-{handler}-{uuid.uuid4().hex[:4]}"
    ids = ids or [f"{channel}-{i}" for i in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        if db is None:
            db = await stack.enter_async_context(fresh_database())
        try:
            if kind.startswith("kafka"):
                await kafka_publish(channel, ids)
            else:
                await rabbit_publish(channel, ids)
            worker = Worker(
                kind,
                channel,
                db,
                n=len(ids),
                handler=handler,
                broker=broker_of(kind),
                group=f"g-{channel}",
                **opts,
            )
            result = await worker.result()
        finally:
            # The publishing handlers' destination goes too.
            channels = [channel, out_channel(channel)] if handler in PUBLISHING else [channel]
            if kind.startswith("kafka"):
                await kafka_delete(channels)
            else:
                await rabbit_delete(channels)
    result["rate"] = round(rate(result), 1)
    result["n"] = len(ids)
    if result.get("relayed_last") and result.get("first"):
        # Through the outbox, done is when the relay had the last message confirmed.
        span = result["relayed_last"] - result["first"]
        result["relayed_rate"] = round(result["count"] / span, 1) if span > 0 else 0.0
    print(f"  {kind:18} {handler:12} {result['rate']:>10.0f} msg/s", flush=True)
    return result
