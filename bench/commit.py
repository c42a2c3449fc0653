"""The machine's durable commit: one single-row INSERT at a time, alone, committed and flushed.

    .venv/bin/python -m bench.commit [--n 2000]

One connection in autocommit with `synchronous_commit = on` inserts a fresh row into a scratch
table of a fresh database, n times one after the other, and reports the round trip's p50/p99 in
milliseconds. Issue 26's latency target is relative to it (p99 added over the raw client at most
2 x this p99 + 5 ms), so `make bench` measures it in the same run (bench.run's `commit`).
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

import asyncpg  # noqa: E402

from bench.harness import fresh_database  # noqa: E402
from dedupe.claims.database import connect_options  # noqa: E402

WARM_UP = 50  # inserts before the timed ones: the plan, the first pages, the connection


def percentile(sorted_ms: list[float], p: float) -> float | None:
    if not sorted_ms:
        return None
    return round(sorted_ms[min(len(sorted_ms) - 1, int(p * len(sorted_ms)))], 3)


async def commit_latency(n: int) -> dict[str, Any]:
    """p50/p99/max of n durable single-row INSERTs, each its own transaction, on one connection."""
    n = max(1, n)
    async with fresh_database() as url:
        conn = await asyncpg.connect(url, **connect_options(url))
        try:
            await conn.execute("SET synchronous_commit = on")
            await conn.execute(
                "CREATE TABLE bench_commit (id bigint PRIMARY KEY,"
                " at timestamptz NOT NULL DEFAULT now())"
            )
            insert = await conn.prepare("INSERT INTO bench_commit (id) VALUES ($1)")
            for i in range(WARM_UP):
                await insert.fetch(-1 - i)
            took: list[float] = []
            for i in range(n):
                began = time.perf_counter()
                await insert.fetch(i)
                took.append((time.perf_counter() - began) * 1000)
            setting = await conn.fetchval("SHOW synchronous_commit")
            fsync = await conn.fetchval("SHOW fsync")
        finally:
            await conn.close()
    took.sort()
    result = {
        "n": n,
        "p50_ms": percentile(took, 0.50),
        "p99_ms": percentile(took, 0.99),
        "max_ms": round(took[-1], 3),
        "mean_ms": round(sum(took) / len(took), 3),
        "synchronous_commit": setting,
        "fsync": fsync,
    }
    print(
        f"  durable single-row INSERT: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms"
        f" ({n} commits)",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="timed commits")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(commit_latency(min(args.n, 1_000_000))), indent=2))


if __name__ == "__main__":
    main()
