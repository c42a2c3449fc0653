"""The latency sweep: publish-to-settled p50/p99 of raw clients and dedupe-worker, side by side,
at offered rates paced in 10 ms ticks (bench.run's `latency` scenario)."""

from __future__ import annotations

import asyncio
import gc
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench.harness import (
    AMQP_URL,
    KAFKA_URL,
    RUN,
    Worker,
    broker_of,
    fresh_database,
    kafka_delete,
    rabbit_delete,
    rabbit_publish,
)

# The offered rates of the latency sweep (BENCH_LATENCY_RATES), to which every run adds the fixed
# rate of the target and half of dedupe-worker's maximum on that broker.
SWEEP_RATES = "250,500,1000,2000"
FIXED_RATE = 1000
SETTLE_S = 30.0  # after the last publish, how long a behind worker may take to settle the rest


async def latency(report: dict[str, Any], uvloop: bool, maxima: dict[str, float]) -> None:
    """p50/p99 publish-to-settled over a sweep of offered rates, raw and dedupe-worker side by side.

    The two target rates (1,000 msg/s and half of the worker's measured maximum) get the longer
    window (BENCH_LATENCY_S), the other sweep points BENCH_SWEEP_S; at each rate the raw client
    runs right before dedupe-worker, so both see the same machine.
    """
    target_s = float(os.environ.get("BENCH_LATENCY_S", "10"))
    sweep_s = float(os.environ.get("BENCH_SWEEP_S", "5"))
    sweep = [round(float(r)) for r in os.environ.get("BENCH_LATENCY_RATES", SWEEP_RATES).split(",")]
    half_max = {broker: round(max(100.0, rate / 2)) for broker, rate in maxima.items()}
    runs: dict[str, Any] = {}
    for broker in ("rabbit", "kafka"):
        targets = {FIXED_RATE, half_max[broker]}
        # A sweep point within 10 % of a target rate would measure the same thing again.
        near = {r for r in sweep if any(abs(r - t) <= 0.1 * t for t in targets)}
        for rate in sorted(({*sweep} - near) | targets):
            window = target_s if rate in targets else sweep_s
            for kind in (f"{broker}-raw", f"{broker}-dedupe"):
                runs[f"{kind}@{rate}"] = await paced_run(kind, rate, window, uvloop)
    report["latency"] = {
        "fixed_rate": FIXED_RATE,
        "maxima": {broker: round(rate) for broker, rate in maxima.items()},
        "half_max": half_max,
        "runs": runs,
    }


async def paced_run(kind: str, target: float, duration_s: float, uvloop: bool) -> dict[str, Any]:
    """One worker fed `target` messages per second for `duration_s`; it stops once all settled."""
    channel = f"bench-{RUN}-lat-{kind}-{uuid.uuid4().hex[:4]}"
    total = max(1, int(target * duration_s))
    async with fresh_database() as db:
        try:
            if kind.startswith("kafka"):
                from dedupe.transport import dlq_name
                from dedupe_kafka import KafkaOptions, ensure_topics

                await ensure_topics(KafkaOptions.from_url(KAFKA_URL), [channel, dlq_name(channel)])
            else:
                await rabbit_publish(channel, [])
            worker = Worker(
                kind,
                channel,
                db,
                latency=True,
                n=total,
                handler="noop",
                broker=broker_of(kind),
                group=f"g-{channel}",
                uvloop=uvloop,
                time_limit_s=round(duration_s + SETTLE_S + 120),
            )
            await worker.ready()
            await asyncio.sleep(3 if kind.startswith("kafka") else 0.5)  # group join
            began = time.monotonic()
            sent = await pace(kind, channel, target, total)
            paced_s = time.monotonic() - began
            if not await worker.exited(SETTLE_S):
                worker.stop()  # a worker that fell behind: its unsettled messages are counted
            result = await worker.result()
        finally:
            if kind.startswith("kafka"):
                await kafka_delete([channel])
            else:
                await rabbit_delete([channel])
    result.pop("rss_mb", None)
    result["sent"] = sent
    result["target_rate"] = round(target)
    # The load generator shares the cores too: what it achieved is the rate actually offered.
    result["offered_rate"] = round(sent / paced_s, 1) if paced_s > 0 else None
    result["window_s"] = duration_s
    print(
        f"  {kind:18} p50 {result['p50_ms']} ms  p99 {result['p99_ms']} ms at {target:.0f}/s"
        f" ({result['count']} of {sent} settled)",
        flush=True,
    )
    return result


async def pace(kind: str, channel: str, target: float, total: int) -> int:
    """Publish `total` messages at `target` per second in 10 ms ticks; body = send time.

    Exactly `total`: the worker stops once it has settled that many (its `--n`), so a last
    tick that went past it (whole ticks of round(target / 100) each) was counted as sent and
    never settled: ~50 of 63,872 short at 6,381/s, on the raw client as on dedupe-worker.
    """
    if kind.startswith("kafka"):
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(
            bootstrap_servers=KAFKA_URL.removeprefix("kafka://"), acks=1, linger_ms=0
        )
        await producer.start()
        # The acks not yet in, and a count of the refused: a list of every ack (100,000 futures
        # at 10,000/s) made this process's full collections grow to 75 ms, and each pause came
        # out as a burst the worker then had to absorb (see _paced).
        pending: set[asyncio.Future[Any]] = set()
        failed = 0

        def acked(ack: asyncio.Future[Any]) -> None:
            nonlocal failed
            pending.discard(ack)
            if ack.cancelled() or ack.exception() is not None:
                failed += 1

        async def record(i: int) -> None:
            mid = f"{channel}-{i}".encode()
            ack = await producer.send(
                channel, b"t%.6f" % time.time(), key=mid, headers=[("message-id", mid)]
            )
            pending.add(ack)
            ack.add_done_callback(acked)

        try:
            await _paced(record, target, total)
            if pending:
                await asyncio.wait(set(pending))
        finally:
            await producer.stop()
        # A record the broker did not take was never offered: counting it would make the
        # worker look as if it lost it.
        if failed:
            print(f"  ({failed} of {total} records not taken by Kafka)", flush=True)
        return total - failed
    import aio_pika

    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        amqp = await connection.channel(publisher_confirms=False)

        async def message(i: int) -> None:
            await amqp.default_exchange.publish(
                aio_pika.Message(b"t%.6f" % time.time(), message_id=f"{channel}-{i}"),
                routing_key=channel,
            )

        await _paced(message, target, total)
        # A round trip on the channel once all are written, so a close right after the last
        # tick cannot drop it.
        await amqp.declare_queue(channel, passive=True)
    return total


async def _paced(send: Callable[[int], Awaitable[None]], target: float, total: int) -> None:
    """send(0) .. send(total - 1), round(target / 100) every 10 ms, the clock started once the
    broker is connected (its connecting is no backlog to catch up on).

    While pacing, the objects this process had before it are out of the cyclic GC's reach
    (gc.freeze), so a full collection scans only what the pacing made. A pause of the load
    generator is not offered load: the pacer sends what it missed at once after it, and that
    burst, not the rate, was the tail it measured."""
    per_tick = max(1, round(target * 0.01))
    loop = asyncio.get_running_loop()
    gc.collect()
    gc.freeze()
    try:
        start, sent = loop.time(), 0
        while sent < total:
            for _ in range(min(per_tick, total - sent)):
                await send(sent)
                sent += 1
            await asyncio.sleep(max(0.0, start + sent / target - loop.time()))
    finally:
        gc.unfreeze()
