"""Benchmarks of dedupe-worker against the raw clients and the hand-written alternative.

    .venv/bin/python -m bench.run [--n 20000] [--results DIR]
                                  [--only commit,core,rabbit,kafka,dup,latency,gc,workers,outbox]
    .venv/bin/python -m bench.run --memory [--n 1000000]

Every scenario runs in one go, side by side, and is reported as a ratio to its baseline
(absolute figures on a shared two-core machine are noise). Each consumer is its own process
(bench/worker.py) reading a backlog published beforehand; a fresh database per scenario, its
own queues and topics, all removed at the end. Only 127.0.0.1 services; every loop is bounded.
Writes bench/results/latest.json (memory.json for --memory) and the PNG plots of bench/plots.py
beside it, and prints the Markdown report of bench/report.py (copied into BENCHMARKS.md).
--results (BENCH_RESULTS) puts them elsewhere: a trial run must not replace the figures of record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402

from bench.commit import commit_latency  # noqa: E402
from bench.harness import (  # noqa: E402
    ADMIN_URL,
    RUN,
    SEED_SCOPE,
    Worker,
    backlog_run,
    broker_of,
    fresh_database,
    kafka_delete,
    kafka_publish,
    rabbit_delete,
    rabbit_publish,
    rate,
)
from bench.latency import latency  # noqa: E402
from bench.targets import BROKERS  # noqa: E402

# -- scenarios ------------------------------------------------------------------------------


# bench.core's batch shapes per broker: (deliveries per process() call, calls side by side).
# RabbitMQ's transport hands over at most its prefetch (256, 8 x the default concurrency)
# unacknowledged messages, Kafka's one fetch of batch_max (the same 256) records per partition,
# the bench's topics having 4 partitions.
CORE_SHAPES = {"rabbit": (256, 1), "kafka": (256, 4)}


async def commit(n: int, report: dict[str, Any]) -> None:
    """The machine's durable commit alone (bench.commit): the latency target is relative to it."""
    report["commit"] = await commit_latency(n)


async def cpu(n: int, report: dict[str, Any], uvloop: bool) -> None:
    """CPU per message of the pipeline alone (bench.core, its own process), new keys and then
    the same keys again, with each broker's batch shape."""
    out: dict[str, Any] = {}
    for broker, (batch, batches) in CORE_SHAPES.items():
        cmd = [sys.executable, "-m", "bench.core", "--n", str(n), "--kinds", "new,dup"]
        cmd += ["--batch", str(batch), "--batches", str(batches)]
        if not uvloop:
            cmd.append("--asyncio")
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
        stdout, _ = await asyncio.wait_for(proc.communicate(), 900)
        if proc.returncode != 0:
            raise RuntimeError(f"bench.core failed (exit {proc.returncode}): {' '.join(cmd)}")
        result = json.loads(stdout)
        rounds = {r["kind"]: r for r in result["rounds"]}
        out[broker] = {
            "batch": batch,
            "batches": batches,
            "n": n,
            "new_us": rounds["new"]["cpu_us_per_msg"],
            "dup_us": rounds["dup"]["cpu_us_per_msg"],
            "rounds": result["rounds"],
        }
        print(
            f"  bench.core {BROKERS[broker]:8} ({batches} x {batch}): new key"
            f" {out[broker]['new_us']} us/msg, duplicate {out[broker]['dup_us']} us/msg",
            flush=True,
        )
    report["cpu"] = out


async def throughput(broker: str, n: int, report: dict[str, Any], uvloop: bool) -> None:
    kinds = {
        "rabbit": ["rabbit-raw", "rabbit-dedupe", "rabbit-naive", "rabbit-faststream"],
        "kafka": ["kafka-raw", "kafka-dedupe", "kafka-naive"],
    }[broker]
    out: dict[str, Any] = {}
    for handler in ("noop", "insert"):
        for kind in kinds:
            # The naive consumers commit once per message: fewer messages keep them bounded.
            size = n if "naive" not in kind and "faststream" not in kind else max(n // 4, 1000)
            out[f"{kind}/{handler}"] = await backlog_run(kind, size, handler, uvloop=uvloop)
    # The same worker on the other event loop: does uvloop earn its place?
    dedupe = f"{broker}-dedupe"
    other = await backlog_run(dedupe, n, "noop", uvloop=not uvloop)
    out[f"{dedupe}/noop/{'asyncio' if uvloop else 'uvloop'}"] = other
    if broker == "kafka":
        # The database's own limit for the protocol: claim + complete of new keys with nothing
        # else, at the worker's default batch (256, three in flight per partition of four) and
        # at a large one; the better of the two counts.
        for batch, loops in ((256, 4), (500, 2)):
            async with fresh_database() as db:
                loop = Worker("sql-loop", "none", db, n=n, prefetch=batch, sql_loops=loops)
                res = await loop.result()
            res["rate"] = round(rate(res), 1)
            print(f"  sql-loop {batch}x{loops:<8} {'-':12} {res['rate']:>10.0f} msg/s", flush=True)
            out[f"sql-loop-{batch}x{loops}"] = res
        out["sql-loop"] = max(
            (v for k, v in out.items() if k.startswith("sql-loop-")), key=lambda v: v["rate"]
        )
    report[f"throughput_{broker}"] = out


async def group_commit(broker: str, n: int, report: dict[str, Any], uvloop: bool) -> None:
    """The insert handler again with group_commit=True, beside throughput()'s insert figures."""
    kind = f"{broker}-dedupe"
    out = report.setdefault(f"throughput_{broker}", {})
    out[f"{kind}/insert-group"] = await backlog_run(kind, n, "insert-group", uvloop=uvloop)


async def duplicates(n: int, report: dict[str, Any], uvloop: bool) -> None:
    """New keys, then the very same keys again (a replay): duplicates rate / new rate."""
    out: dict[str, Any] = {}
    for kind in ("rabbit-dedupe", "kafka-dedupe"):
        async with fresh_database() as db:
            ids = [f"dup-{RUN}-{i}" for i in range(n)]
            new = await backlog_run(kind, n, "noop", db=db, ids=ids, uvloop=uvloop)
            dup = await backlog_run(kind, n, "noop", db=db, ids=ids, uvloop=uvloop)
        out[kind] = {"new": new["rate"], "duplicates": dup["rate"], "stats": dup.get("stats")}
    report["duplicates"] = out


async def gc_while_running(n: int, expired: int, report: dict[str, Any], uvloop: bool) -> None:
    """Expired claims deleted per second by `ClaimStore.gc` while a worker takes new ones."""
    from dedupe.claims.database import connect_pool
    from dedupe.claims.store import ClaimStore

    async with fresh_database() as db:
        conn = await asyncpg.connect(db)
        try:
            await conn.execute(
                "INSERT INTO dedupe_claims (scope, key, payload_hash, status, token, owner,"
                " attempts, expires_at) SELECT 'bench.old', 'k' || g, '\\x00', 'completed', 1,"
                " 'bench', 1, now() - interval '1 hour' FROM generate_series(1, $1) g",
                expired,
            )
            await conn.execute("VACUUM ANALYZE dedupe_claims")
        finally:
            await conn.close()
        pool = await connect_pool(db, max_size=2)
        store = ClaimStore(pool, owner="bench-gc")
        deleted = 0
        spans: list[float] = []

        async def clean() -> None:
            nonlocal deleted
            while deleted < expired:
                began = time.monotonic()
                cleaned = await store.gc()
                spans.append(time.monotonic() - began)
                got = cleaned.claims if cleaned is not None else 0
                deleted += got
                if not got:
                    await asyncio.sleep(0.05)

        async with pool:
            began = time.monotonic()
            cleaner = asyncio.create_task(clean())
            worker = await backlog_run("rabbit-dedupe", n, "noop", db=db, uvloop=uvloop)
            cleaned_during = deleted
            await asyncio.wait_for(cleaner, 600)
            took = sum(spans)
    report["gc"] = {
        "expired": expired,
        "deleted": deleted,
        "gc_rate": round(deleted / took, 1) if took else None,
        "deleted_while_worker_ran": cleaned_during,
        "worker_rate": worker["rate"],
        "wall_s": round(time.monotonic() - began, 2),
    }
    print(f"  gc: {report['gc']}", flush=True)


async def workers(n: int, report: dict[str, Any], uvloop: bool) -> None:
    """1, 2 and 4 worker processes on one backlog; rate from the claims' own timestamps."""
    out: dict[str, Any] = {}
    for kind in ("rabbit-dedupe", "kafka-dedupe"):
        for count in (1, 2, 4):
            channel = f"bench-{RUN}-w{count}-{kind}-{uuid.uuid4().hex[:4]}"
            ids = [f"{channel}-{i}" for i in range(n)]
            async with fresh_database() as db:
                try:
                    if kind.startswith("kafka"):
                        await kafka_publish(channel, ids)
                    else:
                        await rabbit_publish(channel, ids)
                    procs = [
                        Worker(
                            kind,
                            channel,
                            db,
                            handler="noop",
                            broker=broker_of(kind),
                            group=f"g-{channel}",
                            uvloop=uvloop,
                            time_limit_s=300,
                        )
                        for _ in range(count)
                    ]
                    conn = await asyncpg.connect(db)
                    try:
                        deadline = time.monotonic() + 300
                        while time.monotonic() < deadline:
                            done = await conn.fetchval(
                                "SELECT count(*) FROM dedupe_claims WHERE status = 'completed'"
                                f" AND scope <> '{SEED_SCOPE}'"
                            )
                            if done >= n:
                                break
                            await asyncio.sleep(0.2)
                        span = await conn.fetchval(
                            "SELECT extract(epoch FROM max(updated_at) - min(created_at))"
                            f" FROM dedupe_claims WHERE scope <> '{SEED_SCOPE}'"
                        )
                    finally:
                        await conn.close()
                        for p in procs:
                            p.stop()
                    results = [await p.result() for p in procs]
                finally:
                    if kind.startswith("kafka"):
                        await kafka_delete([channel])
                    else:
                        await rabbit_delete([channel])
            r = round(n / float(span), 1) if span else 0.0
            out[f"{kind}/{count}"] = {"rate": r, "counts": [x["count"] for x in results]}
            print(f"  {kind:18} x{count} {r:>10.0f} msg/s", flush=True)
    report["workers"] = out


async def outbox(n: int, report: dict[str, Any], uvloop: bool) -> None:
    """A handler that publishes one message: through the outbox (ctx.publish; done when the
    relay has it confirmed) against the same handler publishing directly with a confirming
    publisher before it returns. Alternated twice per broker; the better run of each counts."""
    out: dict[str, Any] = {}
    for broker in ("rabbit", "kafka"):
        kind = f"{broker}-dedupe"
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "outbox": []}
        for _ in range(2):
            for handler in ("direct", "outbox"):
                runs[handler].append(await backlog_run(kind, n, handler, uvloop=uvloop))
        direct = max(runs["direct"], key=lambda r: r["rate"])
        relayed = max(runs["outbox"], key=lambda r: r.get("relayed_rate", 0.0))
        out[f"{kind}/direct"] = direct
        out[f"{kind}/outbox"] = relayed
        out[f"{kind}/runs"] = {
            "direct": [r["rate"] for r in runs["direct"]],
            "outbox": [r.get("relayed_rate") for r in runs["outbox"]],
            "outbox_handler": [r["rate"] for r in runs["outbox"]],
        }
        print(
            f"  {kind:18} outbox {relayed.get('relayed_rate', 0):>10.0f} msg/s relayed "
            f"({relayed['rate']:.0f} msg/s handled)",
            flush=True,
        )
    report["outbox"] = out


async def memory(n: int, report: dict[str, Any], uvloop: bool) -> None:
    """RSS of one Kafka worker across n messages (sampled every 2 s)."""
    result = await backlog_run(
        "kafka-dedupe", n, "noop", uvloop=uvloop, rss_every_s=2, time_limit_s=3600
    )
    report["memory"] = {
        "n": n,
        "rate": result["rate"],
        "rss_mb": result["rss_mb"],
        "max_rss_mb": result["max_rss_mb"],
    }


def machine() -> dict[str, Any]:
    def cmd(*args: str) -> str:
        with contextlib.suppress(Exception):
            return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
        return "?"

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        ),
        "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "postgres": cmd("psql", ADMIN_URL, "-Atc", "SHOW server_version"),
        "load_before": os.getloadavg(),
        "commit": cmd("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"),
        # Changes to tracked files other than the results themselves make the figures unofficial.
        "dirty": bool(
            cmd(
                "git",
                "-C",
                str(ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!bench/results",
            )
        ),
    }


async def main(args: argparse.Namespace) -> None:
    results = Path(args.results)
    await asyncio.to_thread(results.mkdir, parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": machine(),
        "n": args.n,
        "uvloop": args.uvloop,
        "command": " ".join(sys.argv),
    }
    started = time.monotonic()
    if args.memory:
        print(f"memory: {args.n} messages", flush=True)
        await memory(args.n, report, args.uvloop)
        path = results / "memory.json"
    else:
        only = set(args.only.split(","))
        if "commit" in only:
            print("the machine's durable commit (a single-row INSERT, alone)", flush=True)
            await commit(args.commit_n, report)
        if "core" in only:
            print("CPU per message in the pipeline alone (bench.core)", flush=True)
            await cpu(args.core_n, report, args.uvloop)
        if "rabbit" in only:
            print("RabbitMQ throughput", flush=True)
            await throughput("rabbit", args.n, report, args.uvloop)
            await group_commit("rabbit", args.n, report, args.uvloop)
        if "kafka" in only:
            print("Kafka throughput", flush=True)
            await throughput("kafka", args.n, report, args.uvloop)
            await group_commit("kafka", args.n, report, args.uvloop)
        if "dup" in only:
            print("duplicates", flush=True)
            await duplicates(args.n, report, args.uvloop)
        if "latency" in only:
            print("latency over offered rates", flush=True)
            maxima = {
                "rabbit": report.get("throughput_rabbit", {})
                .get("rabbit-dedupe/noop", {})
                .get("rate", float(os.environ.get("BENCH_MAX_RABBIT", "4000"))),
                "kafka": report.get("throughput_kafka", {})
                .get("kafka-dedupe/noop", {})
                .get("rate", float(os.environ.get("BENCH_MAX_KAFKA", "8000"))),
            }
            await latency(report, args.uvloop, maxima)
        if "gc" in only:
            print("clean-up while running", flush=True)
            await gc_while_running(args.n, args.expired, report, args.uvloop)
        if "workers" in only:
            print("worker processes", flush=True)
            await workers(args.n, report, args.uvloop)
        if "outbox" in only:
            print("a publish through the outbox against a direct publish", flush=True)
            await outbox(args.n, report, args.uvloop)
        # The outbox scenario alone keeps its own file: latest.json is the full run's.
        path = results / ("outbox.json" if only == {"outbox"} else "latest.json")
    report["machine"]["load_after"] = os.getloadavg()
    report["wall_s"] = round(time.monotonic() - started, 1)
    path.write_text(json.dumps(report, indent=1))
    from bench.report import render

    print(render(report))
    print(f"\n(results in {path}; {report['wall_s']} s)")
    write_plots(report, results)


def write_plots(report: dict[str, Any], results: Path) -> None:
    """The PNG plots of bench/plots.py beside the JSON (the `bench` extra has matplotlib)."""
    try:
        from bench.plots import plot_report
    except ImportError as exc:
        print(f"(no plots: {exc}; pip install -e '.[bench]')", flush=True)
        return
    for png in plot_report(report, results):
        print(f"(plot {png})", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="dedupe-worker benchmarks")
    parser.add_argument("--n", type=int, default=int(os.environ.get("BENCH_N", "20000")))
    parser.add_argument(
        "--only",
        default=os.environ.get(
            "BENCH_ONLY", "commit,core,rabbit,kafka,dup,latency,gc,workers,outbox"
        ),
    )
    parser.add_argument(
        "--commit-n",
        type=int,
        default=int(os.environ.get("BENCH_COMMIT_N", "2000")),
        help="timed commits of the `commit` scenario (BENCH_COMMIT_N)",
    )
    parser.add_argument(
        "--core-n",
        type=int,
        default=int(os.environ.get("BENCH_CORE_N", "0")) or None,
        help="messages per round of the `core` scenario (BENCH_CORE_N; default --n)",
    )
    parser.add_argument(
        "--expired", type=int, default=int(os.environ.get("BENCH_EXPIRED", "100000"))
    )
    parser.add_argument("--memory", action="store_true")
    parser.add_argument(
        "--results",
        default=os.environ.get("BENCH_RESULTS", str(ROOT / "bench" / "results")),
        help="folder for the JSON and the plots (BENCH_RESULTS)",
    )
    parser.add_argument(
        "--uvloop",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("BENCH_UVLOOP", "1") == "1",
    )
    arguments = parser.parse_args()
    arguments.core_n = arguments.core_n or arguments.n
    asyncio.run(main(arguments))
