"""One benchmark consumer, run as its own process by bench/run.py (never by the test suite).

    python -m bench.worker KIND --channel C --n N --db URL
                           [--handler noop|insert|insert-group|outbox|direct] ...

KIND is one of:
  rabbit-raw        aio-pika consume + ack, nothing else
  rabbit-naive      aio-pika + the hand-written check: SELECT, then INSERT, one transaction each
  rabbit-faststream a FastStream subscriber with the same naive check
  rabbit-dedupe     dedupe-worker's Processor on its RabbitMQ transport
  kafka-raw         aiokafka getmany + commit, nothing else
  kafka-naive       aiokafka getmany + the naive check per record + commit per batch
  kafka-dedupe      dedupe-worker's Processor on its Kafka transport
  sql-loop          no broker: batched claim_batch + complete on the pool (the database's limit)

Prints `READY` once consuming, then one JSON line with the count, wall-clock times of the
first message and of the n-th settled one, latency percentiles and RSS samples. Every loop is
bounded by --n and --time-limit-s; only 127.0.0.1 services are used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
import psutil  # noqa: E402

INSERT_ROW = "INSERT INTO bench_rows (id) VALUES ($1)"
NAIVE_SELECT = "SELECT 1 FROM bench_processed WHERE key = $1"
NAIVE_INSERT = "INSERT INTO bench_processed (key) VALUES ($1)"


class Tally:
    """Counts settled messages, remembers first/last times, latencies and RSS samples."""

    def __init__(self, n: int, stop: asyncio.Event, *, rss_every_s: float) -> None:
        self.n = n
        self.stop = stop
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.latencies: list[float] = []
        # BENCH_LATENCY_TIMELINE=<file>: every settle's (time, latency), written at the end, to
        # tell a queue that grows from stalls that come and go.
        self.timeline: list[tuple[float, float]] | None = (
            [] if os.environ.get("BENCH_LATENCY_TIMELINE") else None
        )
        self.rss: list[tuple[float, int, float]] = []  # (t, count, MB)
        self.rss_every_s = rss_every_s
        self._proc = psutil.Process()

    def arrived(self) -> None:
        if self.first is None:
            self.first = time.time()

    def settled(self, body: bytes | None = None, k: int = 1) -> None:
        now = time.time()
        if body is not None and body[:1] == b"t":
            self.latencies.append(now - float(body[1:18]))
            if self.timeline is not None:
                self.timeline.append((now, self.latencies[-1]))
        self.count += k
        self.last = now
        if self.n and self.count >= self.n:
            self.stop.set()

    async def sample_rss(self) -> None:
        start = time.time()
        while self.rss_every_s > 0:
            mb = self._proc.memory_info().rss / 2**20
            self.rss.append((round(time.time() - start, 1), self.count, round(mb, 1)))
            await asyncio.sleep(self.rss_every_s)

    def report(self, **extra: Any) -> dict[str, Any]:
        if self.timeline:
            Path(os.environ["BENCH_LATENCY_TIMELINE"]).write_text(
                "".join(f"{t:.4f} {latency:.4f}\n" for t, latency in self.timeline)
            )
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else None

        return {
            "count": self.count,
            "first": self.first,
            "last": self.last,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "latency_samples": len(lat),
            "rss_mb": self.rss,
            "max_rss_mb": round(self._proc.memory_info().rss / 2**20, 1),
            **extra,
        }


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

    pool = await asyncpg.create_pool(args.db, min_size=1, max_size=args.concurrency + 4)
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

    pool = await asyncpg.create_pool(args.db, min_size=1, max_size=args.concurrency + 4)
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


# -- dedupe-worker --------------------------------------------------------------------------


async def dedupe(args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    from bench.apps import make_app
    from dedupe.pipeline import Processor
    from dedupe.settings import Settings
    from dedupe.store import ClaimStore, connect_pool
    from dedupe.transport import Transport

    publisher: Any = None
    if args.handler in ("outbox", "direct"):
        # The relay's publisher (outbox) or the handler's own (direct): the same confirming
        # publisher the worker gets from its transport plugin.
        if args.broker.startswith("kafka://"):
            from consumers.kafka import KafkaPublisher

            publisher = KafkaPublisher(args.broker)
        else:
            from consumers.rabbitmq import RabbitMQPublisher

            publisher = RabbitMQPublisher(args.broker)
    app = make_app(args.channel, args.handler, tally, publisher=publisher)
    settings = Settings(
        database_url=args.db,
        broker_url=args.broker,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        worker_name=f"bench:{os.getpid()}",
    )
    transport: Transport
    if args.broker.startswith("kafka://"):
        from consumers.kafka import KafkaTransport

        transport = KafkaTransport(args.broker, settings=settings, app_name=args.group)
    else:
        from consumers.rabbitmq import RabbitMQTransport

        transport = RabbitMQTransport(
            args.broker, prefetch=settings.effective_prefetch, batch_max=settings.effective_prefetch
        )
    pool = await connect_pool(args.db, max_size=settings.concurrency + 4)
    statements: dict[str, list[int]] = {}  # name -> [statements, items]
    async with pool:
        store = ClaimStore(pool, owner=settings.worker_name)
        from dedupe.worker import WARM_CONNECTIONS

        await store.warm_up(WARM_CONNECTIONS)  # as dedupe.Worker does at its start
        for name in ("claim_batch", "complete"):
            method = getattr(store, name)

            async def counted(
                items: Any, *a: Any, _m: Any = method, _n: str = name, **kw: Any
            ) -> Any:
                tally_ = statements.setdefault(_n, [0, 0])
                tally_[0] += 1
                tally_[1] += len(items)
                return await _m(items, *a, **kw)

            setattr(store, name, counted)
        async with Processor(
            app,
            store,
            concurrency=settings.concurrency,
            gc_interval_s=None,
            publisher=publisher if args.handler == "outbox" else None,
        ) as processor:

            async def process(channel: str, deliveries: Any) -> None:
                tally.arrived()
                await processor.process(channel, deliveries)
                if not args.latency:
                    done = processor.stats.completed + processor.stats.duplicates
                    tally.settled(k=done - tally.count)

            async def announce() -> None:
                # Ready once the broker hands us messages: on Kafka, once partitions are ours
                # (a latency run must not count the group join as latency).
                for _ in range(600):  # bounded: a minute
                    await asyncio.sleep(0.1)
                    if getattr(transport, "assignment", True):
                        break
                print("READY", flush=True)

            from dedupe.worker import freeze_startup_heap

            freeze_startup_heap()  # as `dedupe-worker run` does once started
            ready = asyncio.create_task(announce())
            serving = asyncio.create_task(transport.serve(list(app.channels), process, tally.stop))
            await asyncio.wait(
                [serving, asyncio.create_task(tally.stop.wait())],
                return_when=asyncio.FIRST_COMPLETED,
            )
            ready.cancel()
            await processor.drain(timeout_s=10)
            await serving
            await transport.close()
            extra: dict[str, Any] = {}
            if args.handler == "outbox":
                # Done only once the relay has every message confirmed by the broker.
                extra["relayed_last"] = await relayed(pool, tally, args.time_limit_s)
            if publisher is not None:
                await publisher.close()
            return {"stats": processor.stats.snapshot(), "statements": statements, **extra}


async def relayed(pool: Any, tally: Tally, limit_s: float) -> float | None:
    """When the outbox had no unsent row left (polled every 10 ms, for at most limit_s)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not await pool.fetchval("SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL"):
            return time.time()
        await asyncio.sleep(0.01)
    return None


# -- Kafka ----------------------------------------------------------------------------------


async def kafka_plain(args: argparse.Namespace, tally: Tally, naive: bool) -> dict[str, Any]:
    from aiokafka import AIOKafkaConsumer

    pool = await asyncpg.create_pool(args.db, min_size=1, max_size=4)
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
    from dedupe.store import ClaimRequest, ClaimStore, Fence, connect_pool

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


KINDS: dict[str, Callable[[argparse.Namespace, Tally], Any]] = {
    "rabbit-raw": lambda a, t: rabbit_plain(a, t, naive=False),
    "rabbit-naive": lambda a, t: rabbit_plain(a, t, naive=True),
    "rabbit-faststream": rabbit_faststream,
    "rabbit-dedupe": dedupe,
    "kafka-raw": lambda a, t: kafka_plain(a, t, naive=False),
    "kafka-naive": lambda a, t: kafka_plain(a, t, naive=True),
    "kafka-dedupe": dedupe,
    "sql-loop": sql_loop,
}


async def main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tally = Tally(args.n, stop, rss_every_s=args.rss_every_s)
    sampler = asyncio.create_task(tally.sample_rss())
    limit = loop.call_later(args.time_limit_s, stop.set)
    profiler: Any = None
    if args.profile and args.profile.endswith(".prof"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    elif args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(async_mode="disabled")
        profiler.start()
    try:
        extra = await KINDS[args.kind](args, tally)
    finally:
        limit.cancel()
        sampler.cancel()
        if profiler is not None and args.profile.endswith(".prof"):
            profiler.disable()
            profiler.dump_stats(args.profile)
        elif profiler is not None:
            profiler.stop()
            text = profiler.output_text(unicode=False, show_all=False)
            await asyncio.to_thread(Path(args.profile).write_text, text)
    print(json.dumps(tally.report(kind=args.kind, **(extra or {}))), flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--channel", required=True)
    parser.add_argument("--n", type=int, default=0, help="stop after n messages (0: at SIGTERM)")
    parser.add_argument("--db", required=True)
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--group", default="bench")
    # insert-group: the same insert with group_commit=True (dedupe kinds only).
    parser.add_argument(
        "--handler",
        choices=["noop", "insert", "insert-group", "outbox", "direct"],
        default="noop",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prefetch", type=int, default=64)
    parser.add_argument("--sql-loops", type=int, default=4)
    parser.add_argument("--latency", action="store_true", help="stop at SIGTERM, time bodies")
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--rss-every-s", type=float, default=0)
    parser.add_argument("--time-limit-s", type=float, default=300)
    parser.add_argument("--profile", help="write a pyinstrument text profile here")
    args = parser.parse_args(argv)
    if args.handler == "insert-group" and KINDS[args.kind] is not dedupe:
        # The plain consumers have no group commit; they would silently run the no-op.
        parser.error(f"--handler insert-group needs a dedupe kind, not {args.kind}")
    return args


if __name__ == "__main__":
    arguments = parse()
    if arguments.uvloop:
        import uvloop

        uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(arguments))
