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


from bench.baselines import kafka_plain, rabbit_faststream, rabbit_plain, sql_loop  # noqa: E402
from bench.tally import Tally  # noqa: E402

# -- dedupe-worker --------------------------------------------------------------------------


async def dedupe(args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    from bench.apps import make_app
    from dedupe.claims.database import connect_pool
    from dedupe.claims.store import ClaimStore
    from dedupe.pipeline.processor import Processor
    from dedupe.settings import Settings
    from dedupe.transport import Transport

    publisher: Any = None
    if args.handler in ("outbox", "direct"):
        # The relay's publisher (outbox) or the handler's own (direct): the same confirming
        # publisher the worker gets from its transport plugin.
        if args.broker.startswith("kafka://"):
            from dedupe_kafka.publisher import KafkaPublisher

            publisher = KafkaPublisher(args.broker)
        else:
            from dedupe_rabbitmq.publisher import RabbitMQPublisher

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
        from dedupe_kafka.transport import KafkaTransport

        transport = KafkaTransport(args.broker, settings=settings, app_name=args.group)
    else:
        from dedupe_rabbitmq.transport import RabbitMQTransport

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
    # The product's default prefetch (8 x the default concurrency of 32), for every consumer:
    # the raw clients get the same window (RabbitMQ) and batch (Kafka's getmany).
    parser.add_argument("--prefetch", type=int, default=int(os.environ.get("BENCH_PREFETCH", 256)))
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
