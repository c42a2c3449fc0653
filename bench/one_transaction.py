"""One transaction against two commits, in one run: a handler with one `ctx.db` insert, its
first deliveries run with one_transaction=True and with False (rounds alternate), the pipeline
alone (no broker) on a real PostgreSQL.

    .venv/bin/python -m bench.one_transaction [--n 5000] [--batch 100] [--batches 4] [--rounds 2]

Reports per mode: the worker process's CPU per message (`time.process_time`), messages per
second, and the transactions PostgreSQL committed per message (pg_stat_database.xact_commit of
the bench's own database, read after the round's pool is closed: exiting backends report their
counts; less an idle pool's). Both modes release the ctx.db connection with the pool's reset,
which is one (read-only) transaction more per message on either side; `durable` leaves it out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import core  # noqa: E402
from bench.harness import fresh_database  # noqa: E402
from dedupe import App, Context  # noqa: E402
from dedupe.claims.database import connect_pool  # noqa: E402
from dedupe.claims.store import ClaimStore  # noqa: E402
from dedupe.pipeline.processor import Processor  # noqa: E402
from dedupe.testing.deliveries import MemoryDelivery  # noqa: E402

CHANNEL = "onetx"


def insert_app(one_transaction: bool) -> App:
    app = App("bench")

    @app.handler(CHANNEL, name="insert", one_transaction=one_transaction)
    async def insert(body: bytes, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO bench_rows (id) VALUES ($1)", ctx.key)

    return app


def deliveries(start: int, count: int, *, prefix: str) -> list[MemoryDelivery]:
    # First deliveries, as a broker marks them.
    return core.deliveries(CHANNEL, start, count, prefix=prefix, meta={"redelivered": False})


async def xact_commit(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(
            await conn.fetchval(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            )
        )
    finally:
        await conn.close()


async def one_round(
    url: str, args: argparse.Namespace, one_transaction: bool | None, prefix: str
) -> dict[str, Any]:
    """A round on a pool of its own (None: the pool opened and closed idle, the baseline)."""
    before = await xact_commit(url)
    size = args.concurrency + 4
    pool = await connect_pool(url, min_size=size, max_size=size)
    cpu = wall = 0.0
    acked = 0
    stats: dict[str, Any] = {}
    async with pool:
        if one_transaction is not None:
            store = ClaimStore(pool, owner="bench-onetx")
            app = insert_app(one_transaction)
            async with Processor(
                app, store, concurrency=args.concurrency, gc_interval_s=None, heartbeat_s=3600
            ) as processor:
                batches = [
                    deliveries(i, min(args.batch, args.n - i), prefix=prefix)
                    for i in range(0, args.n, args.batch)
                ]
                cpu, wall, acked = await core.timed(processor, CHANNEL, batches, args.batches)
                stats = processor.stats.snapshot()
    await asyncio.sleep(1.0)  # the closed pool's backends report their counts as they exit
    return {
        "commits": await xact_commit(url) - before,
        "cpu": cpu,
        "wall": wall,
        "acked": acked,
        "one_transaction_runs": stats.get("one_transaction", 0),
        "fallbacks": stats.get("one_transaction_fallbacks", {}),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    async with fresh_database() as url:
        # Warm up imports and the server's caches with one small round of each.
        for mode in (True, False):
            await one_round(url, argparse.Namespace(**{**vars(args), "n": 200}), mode, f"w{mode}")
        idle = (await one_round(url, args, None, "idle"))["commits"]
        results: dict[str, list[dict[str, Any]]] = {"one_transaction": [], "two_commit": []}
        for number in range(args.rounds):
            for mode in (True, False) if number % 2 == 0 else (False, True):
                name = "one_transaction" if mode else "two_commit"
                got = await one_round(url, args, mode, f"r{number}{name}")
                got["commits"] -= idle
                results[name].append(got)
        summary: dict[str, Any] = {}
        for name, rounds in results.items():
            summary[name] = {
                "acked": [r["acked"] for r in rounds],
                "cpu_us_per_msg": round(
                    statistics.median(r["cpu"] for r in rounds) / args.n * 1e6, 1
                ),
                "msg_per_s": round(args.n / statistics.median(r["wall"] for r in rounds)),
                "commits_per_msg": round(
                    statistics.median(r["commits"] for r in rounds) / args.n, 3
                ),
                # Less the pool's reset of the ctx.db connection (one per message, both modes).
                "durable_commits_per_msg": round(
                    statistics.median(r["commits"] for r in rounds) / args.n - 1, 3
                ),
                "one_transaction_runs": [r["one_transaction_runs"] for r in rounds],
                "fallbacks": [r["fallbacks"] for r in rounds],
            }
        one, two = summary["one_transaction"], summary["two_commit"]
        return {
            "n": args.n,
            "batch": args.batch,
            "batches": args.batches,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "uvloop": args.uvloop,
            **summary,
            "rate_ratio": round(one["msg_per_s"] / two["msg_per_s"], 2),
            "cpu_ratio": round(one["cpu_us_per_msg"] / two["cpu_us_per_msg"], 2),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="messages per round")
    parser.add_argument("--batch", type=int, default=100, help="deliveries per process() call")
    parser.add_argument("--batches", type=int, default=4, help="process() calls side by side")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    parser.add_argument("--asyncio", dest="uvloop", action="store_false", help="no uvloop")
    args = parser.parse_args(argv)
    args.n = max(1, min(args.n, 1_000_000))
    if args.uvloop:
        import uvloop

        uvloop.install()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
