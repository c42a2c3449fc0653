"""CPU per message in the core: the pipeline alone, no broker, a real PostgreSQL.

    .venv/bin/python -m bench.core [--n 20000] [--batch 500] [--batches 4] [--profile out.txt]

Feeds `Processor.process` batches of in-memory deliveries (as Kafka's partitions do: `--batches`
concurrent batches of `--batch` messages) and reports the worker process's own CPU time per
message (`time.process_time`), which a busy machine disturbs far less than a rate does. The
claim and completion statements still go to PostgreSQL; their server-side CPU is not counted.
This is the figure the batch path of issue #6 is tuned against; `make bench` gives the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.apps import make_app  # noqa: E402
from bench.harness import fresh_database  # noqa: E402
from dedupe.claims.database import connect_pool  # noqa: E402
from dedupe.claims.store import ClaimStore  # noqa: E402
from dedupe.pipeline.processor import Processor  # noqa: E402
from dedupe.testing.deliveries import MemoryDelivery, make_message  # noqa: E402
from dedupe.transport import Action  # noqa: E402


def deliveries(
    channel: str, start: int, count: int, *, prefix: str, meta: dict[str, Any] | None = None
) -> list[MemoryDelivery]:
    return [
        MemoryDelivery(
            make_message(channel, b'{"n": %d}' % i, message_id=f"{prefix}-{i}", meta=meta)
        )
        for i in range(start, start + count)
    ]


async def timed(
    processor: Processor, channel: str, batches: list[list[MemoryDelivery]], side_by_side: int
) -> tuple[float, float, int]:
    """Process the batches, `side_by_side` at a time: (CPU s, wall s, deliveries acked)."""
    cpu, wall = time.process_time(), time.perf_counter()
    for group in range(0, len(batches), side_by_side):
        await asyncio.gather(
            *(processor.process(channel, batch) for batch in batches[group : group + side_by_side])
        )
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    acked = sum(
        1
        for batch in batches
        for d in batch
        if d.outcome is not None and d.outcome.action is Action.ACK
    )
    return cpu, wall, acked


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    channel = "core"
    async with fresh_database() as url:
        pool = await connect_pool(url, max_size=args.concurrency + 4)
        async with pool:
            store = ClaimStore(pool, owner="bench-core")
            app = make_app(channel, args.handler)
            async with Processor(
                app, store, concurrency=args.concurrency, gc_interval_s=None
            ) as processor:
                # Warm up: prepared statements, pool connections, imports.
                await processor.process(channel, deliveries(channel, 0, 200, prefix="warm"))
                rounds: list[dict[str, Any]] = []
                for number, kind in enumerate(args.kinds.split(",")):
                    prefix = f"round{number}"  # keys no earlier round has used
                    if kind == "dup":  # the same keys as a completed stream before it
                        await processor.process(
                            channel, deliveries(channel, 0, args.n, prefix=prefix)
                        )
                    batches = [
                        deliveries(channel, i, min(args.batch, args.n - i), prefix=prefix)
                        for i in range(0, args.n, args.batch)
                    ]
                    cpu, wall, acked = await timed(processor, channel, batches, args.batches)
                    rounds.append(
                        {
                            "kind": kind,
                            "n": args.n,
                            "acked": acked,
                            "cpu_us_per_msg": round(cpu / args.n * 1e6, 1),
                            "msg_per_s": round(args.n / wall),
                        }
                    )
                return {
                    "handler": args.handler,
                    "batch": args.batch,
                    "batches": args.batches,
                    "uvloop": args.uvloop,
                    "rounds": rounds,
                    "stats": processor.stats.snapshot(),
                }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per round")
    parser.add_argument("--batch", type=int, default=500, help="deliveries per process() call")
    parser.add_argument("--batches", type=int, default=4, help="process() calls side by side")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--handler", choices=["noop", "insert", "insert-group"], default="noop")
    parser.add_argument("--kinds", default="new,dup", help="rounds: new keys, duplicates")
    parser.add_argument("--asyncio", dest="uvloop", action="store_false", help="no uvloop")
    parser.add_argument("--profile", help="write a pyinstrument text profile here")
    args = parser.parse_args(argv)
    if not set(args.kinds.split(",")) <= {"new", "dup"}:
        parser.error(f"--kinds takes new and dup, comma-separated; got {args.kinds!r}")
    args.n = max(1, min(args.n, 1_000_000))
    if args.uvloop:
        import uvloop

        uvloop.install()
    profiler: Any = None
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(async_mode="disabled")
        profiler.start()
    try:
        report = asyncio.run(measure(args))
    finally:
        if profiler is not None:
            profiler.stop()
            Path(args.profile).write_text(profiler.output_text(unicode=False, show_all=False))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
