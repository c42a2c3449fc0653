"""One Kafka partition kept full by slow handlers: the latency of the other partitions.

    .venv/bin/python -m bench.kafka_mixed [--seconds 10] [--fast-rate 300] [--slow-rate 40]
                                          [--slow-s 0.3]

Partition 0 of a 4-partition topic gets `--slow-rate` messages a second whose handler sleeps
`--slow-s` (enough to keep its fetched batches in flight at the transport's limit), partitions
1-3 share `--fast-rate` messages a second of a no-op. Reported: publish-to-handler p50/p99 of
the fast ones. What it watches (dedupe_kafka.transport.FULL_PAUSE_S): a full partition's
records fetched ahead, left in aiokafka's buffer, hold back its broker's next fetch for the
other partitions for up to 100 ms. One worker in this process, a real PostgreSQL and Kafka on
127.0.0.1. Not in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aiokafka import AIOKafkaProducer  # noqa: E402

from bench.harness import KAFKA_URL, fresh_database, kafka_delete  # noqa: E402
from dedupe import App, Context, Message  # noqa: E402
from dedupe.claims.database import connect_pool  # noqa: E402
from dedupe.claims.store import ClaimStore  # noqa: E402
from dedupe.pipeline.processor import Processor  # noqa: E402
from dedupe_kafka import KafkaOptions, KafkaTransport, ensure_topics  # noqa: E402


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    channel = f"bench-mixed-{uuid.uuid4().hex[:6]}"
    url = f"{KAFKA_URL}?group_id=g-{channel}"
    await ensure_topics(KafkaOptions.from_url(url), [channel])
    fast: list[float] = []
    app = App("mixed")

    @app.handler(channel)
    async def work(message: Message, ctx: Context) -> None:
        if message.meta["partition"] == 0:
            await asyncio.sleep(args.slow_s)
        else:
            fast.append(time.time() - float(message.body))

    try:
        async with fresh_database() as db:
            pool = await connect_pool(db, max_size=40)
            async with pool:
                store = ClaimStore(pool, owner="bench-mixed")
                async with Processor(app, store, concurrency=64, gc_interval_s=None) as processor:
                    transport = KafkaTransport(url)
                    stop = asyncio.Event()
                    serving = asyncio.create_task(
                        transport.serve([channel], processor.process, stop)
                    )
                    for _ in range(300):  # bounded: 30 s for the group to assign
                        if transport.assignment:
                            break
                        await asyncio.sleep(0.1)
                    await publish(channel, args)
                    await asyncio.sleep(args.slow_s * 4 + 2)  # the last ones settle
                    stop.set()
                    await serving
                    await transport.close()
    finally:
        await kafka_delete([channel])
    fast.sort()
    return {
        "fast_messages": len(fast),
        "fast_p50_ms": round(statistics.median(fast) * 1000, 1) if fast else None,
        "fast_p99_ms": round(fast[int(len(fast) * 0.99) - 1] * 1000, 1) if fast else None,
        "fast_max_ms": round(fast[-1] * 1000, 1) if fast else None,
    }


async def publish(channel: str, args: argparse.Namespace) -> None:
    """Both streams in 10 ms ticks for args.seconds: slow ones on partition 0, fast on 1-3."""
    producer = AIOKafkaProducer(
        bootstrap_servers=KAFKA_URL.removeprefix("kafka://"), acks=1, linger_ms=0
    )
    await producer.start()
    try:
        loop = asyncio.get_running_loop()
        start, sent, ticks = loop.time(), 0, int(args.seconds * 100)
        rates = [args.slow_rate] + [args.fast_rate / 3] * 3  # by partition
        for tick in range(ticks):
            for partition, rate in enumerate(rates):
                count = int(rate * (tick + 1) / 100) - int(rate * tick / 100)
                for _ in range(count):
                    mid = f"{channel}-{sent}".encode()
                    sent += 1
                    await producer.send(
                        channel,
                        b"%.6f" % time.time(),
                        key=mid,
                        partition=partition,
                        headers=[("message-id", mid)],
                    )
            await asyncio.sleep(max(0.0, start + (tick + 1) / 100 - loop.time()))
        await producer.flush()
    finally:
        await producer.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--fast-rate", type=float, default=300.0)
    parser.add_argument("--slow-rate", type=float, default=40.0)
    parser.add_argument("--slow-s", type=float, default=0.3)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
