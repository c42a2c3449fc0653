"""The consumers dedupe-worker is compared with, each run by bench/worker.py: the raw clients
(aio-pika consume + ack, aiokafka getmany + commit), the hand-written check users write instead
(SELECT, then INSERT, one transaction per message), a FastStream subscriber with that check, and
a bare batched claim + complete loop on the pool (the database's own limit). Their pools connect
as dedupe's do (connect_options: no TLS to this machine unless the URL asks for it), so that a
ratio does not count TLS against one side only."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, Any

import asyncpg

from dedupe.claims.database import connect_options

if TYPE_CHECKING:  # bench.apps' naive receiver takes the SQL below without psutil (bench.tally)
    from bench.tally import Tally

INSERT_ROW = "INSERT INTO bench_rows (id) VALUES ($1)"
NAIVE_TABLE = (
    "CREATE TABLE bench_processed (key text PRIMARY KEY,"
    " processed_at timestamptz NOT NULL DEFAULT now())"
)
NAIVE_SELECT = "SELECT 1 FROM bench_processed WHERE key = $1"
NAIVE_INSERT = "INSERT INTO bench_processed (key) VALUES ($1)"


async def naive_check(pool: asyncpg.Pool, key: str, insert: bool) -> None:
    """What users write by hand: look the key up, run, remember it; one transaction each."""
    async with pool.acquire() as conn, conn.transaction():
        if await conn.fetchval(NAIVE_SELECT, key) is None:
            if insert:
                await conn.execute(INSERT_ROW, key)
            await conn.execute(NAIVE_INSERT, key)


# -- RabbitMQ -------------------------------------------------------------------------------


async def rabbit_plain(args: argparse.Namespace, tally: Tally, naive: bool) -> dict[str, Any]:
    import aio_pika

    pool = await asyncpg.create_pool(
        args.db, min_size=1, max_size=args.concurrency + 4, **connect_options(args.db)
    )
    connection = await aio_pika.connect(args.broker, timeout=10)
    async with connection, pool:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=args.prefetch)
        queue = await channel.get_queue(args.channel)
        insert = args.handler == "insert"

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            tally.arrived()
            if naive:
                await naive_check(pool, message.message_id or "", insert)
            elif insert:
                await pool.execute(INSERT_ROW, message.message_id)
            await message.ack()
            tally.settled(message.body)

        tag = await queue.consume(on_message)
        print("READY", flush=True)
        await tally.stop.wait()
        await queue.cancel(tag)
    return {}


async def rabbit_faststream(args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    from faststream.rabbit import Channel, RabbitBroker, RabbitMessage, RabbitQueue

    pool = await asyncpg.create_pool(
        args.db, min_size=1, max_size=args.concurrency + 4, **connect_options(args.db)
    )
    broker = RabbitBroker(args.broker, logger=None)
    insert = args.handler == "insert"

    @broker.subscriber(
        RabbitQueue(args.channel, declare=False),
        channel=Channel(prefetch_count=args.prefetch),
    )
    async def handle(body: dict[str, Any], message: RabbitMessage) -> None:
        tally.arrived()
        await naive_check(pool, message.message_id or "", insert)
        tally.settled(message.body)  # acked by FastStream right after we return

    async with pool:
        await broker.start()
        print("READY", flush=True)
        await tally.stop.wait()
        await broker.stop()
    return {}


# -- Kafka ----------------------------------------------------------------------------------


async def kafka_plain(args: argparse.Namespace, tally: Tally, naive: bool) -> dict[str, Any]:
    from aiokafka import AIOKafkaConsumer

    pool = await asyncpg.create_pool(args.db, min_size=1, max_size=4, **connect_options(args.db))
    consumer = AIOKafkaConsumer(
        args.channel,
        bootstrap_servers=args.broker.removeprefix("kafka://"),
        group_id=args.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        fetch_max_wait_ms=100,
    )
    insert = args.handler == "insert"
    async with pool:
        await consumer.start()
        print("READY", flush=True)
        try:
            while not tally.stop.is_set():
                batches = await consumer.getmany(timeout_ms=100, max_records=args.prefetch)
                for records in batches.values():
                    for record in records:
                        tally.arrived()
                        key = dict(record.headers).get("message-id", b"").decode()
                        if naive:
                            await naive_check(pool, key, insert)
                        elif insert:
                            await pool.execute(INSERT_ROW, key)
                if batches:
                    await consumer.commit()
                    for records in batches.values():
                        for record in records:
                            tally.settled(record.value)
        finally:
            await consumer.stop()
    return {}


async def sql_loop(args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    """Claim and complete batches of new keys straight on the pool, `concurrency` loops at once."""
    from dedupe.claims.database import connect_pool
    from dedupe.claims.records import ClaimRequest, Fence
    from dedupe.claims.store import ClaimStore

    pool = await connect_pool(args.db, max_size=args.concurrency + 4)
    async with pool:
        store = ClaimStore(pool, owner="bench-sql")
        print("READY", flush=True)
        batch = args.prefetch
        counter = iter(range(10**9))

        async def loop() -> None:
            while not tally.stop.is_set():
                ids = [next(counter) for _ in range(batch)]
                tally.arrived()
                claims = await store.claim_batch(
                    [ClaimRequest("bench.sql", f"k{i}", b"h") for i in ids],
                    lease_s=30,
                    retention_s=3600,
                )
                await store.complete(
                    [(Fence(c.scope, c.key, c.token or 0), "null", 3600.0) for c in claims]
                )
                tally.settled(k=len(ids))

        await asyncio.gather(*(loop() for _ in range(args.sql_loops)))
    return {}
