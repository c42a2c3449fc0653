"""Benchmark of the webhook receiver against a hand-written one, in the same run.

    .venv/bin/python -m bench.receiver [--requests 3000] [--connections 32] [--paced-s 10]
                                       [--time-limit-s 60] [--commit-n 1000] [--json PATH]

Four servers on 127.0.0.1, all Starlette on uvicorn in one process each with the same event loop
and HTTP implementation, serve POST /webhooks/github with the same GitHub X-Hub-Signature-256
check: `dedupe-worker receive bench.receiver:app` (verify, claim the delivery's key in a fresh
database, publish with confirms, store the reply; a replay gets the stored reply),
bench.apps.hand_written_receiver (verify, publish with confirms to a durable queue, 202; no
database, no dedupe), bench.apps.verify_only_receiver (the same check and 202, nothing else:
the least a receiver does on this stack, the rate no replay can pass) and
bench.apps.naive_receiver (the hand-written one with the check users write by hand, as the
workers' naive consumer: one transaction per request, look the delivery up, publish and
remember a new one). One keep-alive HTTP/1.1 load generator (bench.load) drives each at the
same connection count: the hand-written ones with a new delivery id per request, the receiver
and the naive one with new keys and then the same keys again (replays; for the hand-written
one a replay is one more request, so replays are read against its rate), then the hand-written
one and the receiver's new keys open-loop at half of their own maximum (requests due at a fixed
rate, latency counted from when each was due). bench.commit measures the machine's durable commit
first. Printed: requests/s, p50/p90/p99 and the CPU per request of every phase (the server's,
PostgreSQL's, RabbitMQ's, and with the load generator's the machine's), and issue 28's ratios with
verdicts: new keys >= 0.8x the hand-written rate, replays >= 2x, p99 at half load minus the
hand-written one's at its half load <= 2 x the commit p99 + 5 ms (no verdict when the hand-written
server's p99 at half load exceeds its own at full speed: the machine was busy), and the receiver's
rates over the naive one's (no target). The database and the queues are removed at the end. Every
phase is bounded by its count and --time-limit-s. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import load  # noqa: E402
from bench.targets import added_p99_bound, commit_p99  # noqa: E402
from handlers.webhooks import make_app  # noqa: E402

GITHUB_SECRET = "bench-only-secret"  # a fixed, fake secret: this process signs, it receives
BODY = json.dumps({"ref": "refs/heads/main", "commits": [{"id": "c0ffee"}] * 5}).encode()
SIGNATURE = hmac.new(GITHUB_SECRET.encode(), BODY, hashlib.sha256).hexdigest()

# The app the receiver process loads (`bench.receiver:app`); its channels carry the prefix
# the benchmark passes down, so that they are its own and can be deleted afterwards.
app = make_app(prefix=os.environ.get("BENCH_CHANNEL_PREFIX", "bench-"))

# Issue 28's targets for the receiver against the hand-written one.
NEW_KEYS_TARGET = 0.8
REPLAYS_TARGET = 2.0
HELD = 0.95  # a paced phase that reached less of its rate says nothing about latency at it


def github_request(port: int, delivery: str) -> bytes:
    head = (
        f"POST /webhooks/github HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
        f"X-GitHub-Event: push\r\nX-GitHub-Delivery: {delivery}\r\n"
        f"X-Hub-Signature-256: sha256={SIGNATURE}\r\n\r\n"
    )
    return head.encode() + BODY


async def drive(
    port: int,
    deliveries: list[str],
    args: argparse.Namespace,
    *,
    rate: float | None = None,
) -> dict[str, Any]:
    requests = [github_request(port, delivery) for delivery in deliveries]
    deadline = time.monotonic() + args.time_limit_s
    return await load.phase(
        port, requests, connections=args.connections, deadline=deadline, rate=rate
    )


def line(name: str, r: dict[str, Any]) -> str:
    done = f"{r['requests']}" + (f" of {r['planned']}" if r["requests"] < r["planned"] else "")
    machine = r["cpu_ms"] + r["db_cpu_ms"] + r["broker_cpu_ms"] + r["client_cpu_ms"]
    return (
        f"| {name} | {done} | {r['rate']:,.0f} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | "
        f"{r['p99_ms']:.2f} | {r['cpu_ms']:.2f} | {r['db_cpu_ms']:.2f} | "
        f"{r['broker_cpu_ms']:.2f} | {machine:.2f} | {r['statuses']} |"
    )


def verdict(ok: bool | None, figure: float = 0.0) -> str:
    if ok is None or figure != figure:  # NaN
        return "not measured"
    return "met" if ok else "NOT met"


def held(r: dict[str, Any], target: float) -> bool:
    """The paced phase ran all its requests at (nearly) its rate, every one answered 2xx."""
    answered = sum(n for status, n in r["statuses"].items() if 200 <= status < 300)
    return bool(r["requests"] == r["planned"] == answered and r["rate"] >= HELD * target)


def latency_verdict(
    plain: dict[str, Any],
    plain_half: dict[str, Any],
    new_half: dict[str, Any],
    bound: float | None,
) -> tuple[bool | None, str]:
    """The p99 verdict at half load and, when there is none, why: no bound (no commit p99), a
    paced phase that fell short of its rate or got non-2xx, or a disturbed baseline. At half
    of its maximum, open loop, the hand-written server queues less than at full speed with
    every connection busy; a paced p99 above its full-speed one means something else took the
    machine meanwhile, and a difference against it would flatter the receiver."""
    if not (
        held(plain_half, plain_half["target_rate"]) and held(new_half, new_half["target_rate"])
    ):
        return None, "a paced phase fell short of its rate or got non-2xx"
    if plain_half["p99_ms"] > plain["p99_ms"]:
        return None, (
            f"the hand-written server's p99 at half load ({plain_half['p99_ms']:.2f} ms) "
            f"exceeds its p99 at full speed ({plain['p99_ms']:.2f} ms): the machine was busy, "
            "run again"
        )
    if bound is None:
        return None, "no commit p99 (--commit-n 0)"
    return new_half["p99_ms"] - plain_half["p99_ms"] <= bound, ""


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import asyncpg

    from bench.baselines import NAIVE_TABLE
    from bench.commit import commit_latency
    from bench.harness import SEED_ROWS, seed
    from dedupe.claims.database import migrate

    figures: dict[str, Any] = {}
    if args.commit_n > 0:
        figures["commit"] = await commit_latency(args.commit_n)
    run = uuid.uuid4().hex[:8]
    db_name = f"dedupe_bench_{run}"
    base, _, _ = args.database.rpartition("/")
    db_url = f"{base}/{db_name}"
    prefix = f"bench-{run}-"
    plain_queue = f"{prefix}hand-written-github"
    naive_queue = f"{prefix}naive-github"
    admin = await asyncpg.connect(args.database)
    await admin.execute(f"CREATE DATABASE {db_name}")
    await admin.close()
    try:
        await migrate(db_url)
        conn = await asyncpg.connect(db_url)
        try:
            # The naive receiver's table, as deep as the claims table (bench.harness.seed).
            await conn.execute(NAIVE_TABLE)
            if SEED_ROWS:
                await seed(conn, SEED_ROWS, naive=True)
        finally:
            await conn.close()
        receiver_env = {
            "DEDUPE_DATABASE_URL": db_url,
            "DEDUPE_BROKER_URL": args.broker,
            "DEDUPE_LOG_LEVEL": "WARNING",
            "BENCH_CHANNEL_PREFIX": prefix,
            "GITHUB_WEBHOOK_SECRET": GITHUB_SECRET,
            "STRIPE_WEBHOOK_SECRET": "whsec_bench",
            "BILLING_WEBHOOK_SECRET": "whsec_YmVuY2g=",
            "ORDERS_API_KEYS": "bench-key=bench",
        }
        receive = [sys.executable, "-m", "dedupe.cli", "receive", "bench.receiver:app"]
        receive += ["--event-loop", load.event_loop()]
        plain_env = {
            "GITHUB_WEBHOOK_SECRET": GITHUB_SECRET,
            "BENCH_AMQP_URL": args.broker,
            "BENCH_QUEUE": plain_queue,
        }
        async with (
            load.serving(receive, receiver_env, ready_path="/readyz") as dedupe,
            load.serving(
                load.uvicorn_command("bench.apps:hand_written_receiver"), plain_env
            ) as plain,
            load.serving(
                load.uvicorn_command("bench.apps:verify_only_receiver"),
                {"GITHUB_WEBHOOK_SECRET": GITHUB_SECRET},
            ) as floor,
            load.serving(
                load.uvicorn_command("bench.apps:naive_receiver"),
                {**plain_env, "BENCH_QUEUE": naive_queue, "BENCH_DATABASE_URL": db_url},
            ) as naive,
        ):
            await measure(figures, Servers(dedupe, plain, floor, naive), run, args)
    finally:
        await cleanup(args.database, db_name, args.broker, prefix, [plain_queue, naive_queue])
    return figures


@dataclass(frozen=True)
class Servers:
    """The ports of the four servers."""

    dedupe: int  # dedupe-worker receive
    plain: int  # the hand-written receiver
    floor: int  # the same verifying without publishing
    naive: int  # the hand-written one with the naive check


async def measure(
    figures: dict[str, Any], servers: Servers, run: str, args: argparse.Namespace
) -> None:
    n, c = args.requests, args.connections
    dedupe, plain, floor, naive = servers.dedupe, servers.plain, servers.floor, servers.naive
    print(
        f"POST /webhooks/github (HMAC verified) on 127.0.0.1, {c} keep-alive connections, "
        f"{n} requests per phase; every server uvicorn, one process each, loop "
        f"{load.event_loop()}, http {load.http_implementation()}: dedupe-worker receive on "
        f":{dedupe}, the hand-written receiver on :{plain}, the same verifying without "
        f"publishing on :{floor}, the same with the naive check on :{naive}",
        flush=True,
    )
    warm = min(500, n)
    await drive(plain, [f"{run}-warm-plain-{i}" for i in range(warm)], args)
    await drive(dedupe, [f"{run}-warm-{i}" for i in range(warm)], args)
    await drive(floor, [f"{run}-warm-floor-{i}" for i in range(warm)], args)
    await drive(naive, [f"{run}-warm-naive-{i}" for i in range(warm)], args)
    figures["hand_written"] = await drive(plain, [f"{run}-plain-{i}" for i in range(n)], args)
    figures["verify_only"] = await drive(floor, [f"{run}-floor-{i}" for i in range(n)], args)
    keys = [f"{run}-{i}" for i in range(n)]
    figures["new_keys"] = await drive(dedupe, keys, args)
    figures["replays"] = await drive(dedupe, keys, args)
    naive_keys = [f"{run}-naive-{i}" for i in range(n)]
    figures["naive_new_keys"] = await drive(naive, naive_keys, args)
    figures["naive_replays"] = await drive(naive, naive_keys, args)
    # Open loop at half of each one's own maximum, for --paced-s (at most --time-limit-s).
    for name, port, of in (
        ("hand_written", plain, "hand_written"),
        ("new_keys", dedupe, "new_keys"),
    ):
        half = max(1.0, figures[of]["rate"] / 2)
        count = max(1, int(half * min(args.paced_s, args.time_limit_s)))
        deliveries = [f"{run}-half-{name}-{i}" for i in range(count)]
        figures[f"{name}_half"] = {
            "target_rate": half,
            **await drive(port, deliveries, args, rate=half),
        }
    report(figures, n, c)


def report(figures: dict[str, Any], n: int, c: int) -> None:
    plain, new, replays = figures["hand_written"], figures["new_keys"], figures["replays"]
    plain_half, new_half = figures["hand_written_half"], figures["new_keys_half"]
    print(
        "\n| phase | requests | req/s | p50 ms | p90 ms | p99 ms | CPU ms/req: server "
        "| PostgreSQL | RabbitMQ | all (+ load generator) | statuses |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print(line("hand-written (verify, publish with confirm)", plain))
    print(line("verify only (verify, 202: no receiver does less)", figures["verify_only"]))
    print(line("receiver, new keys (verify, claim, publish, store)", new))
    print(line("receiver, replays (verify, stored reply)", replays))
    print(line("naive check, new keys (look up, publish, remember)", figures["naive_new_keys"]))
    print(line("naive check, replays (look up, 202)", figures["naive_replays"]))
    print(line(f"hand-written, paced at {plain_half['target_rate']:,.0f}/s", plain_half))
    print(line(f"receiver new keys, paced at {new_half['target_rate']:,.0f}/s", new_half))
    base = plain["rate"] or float("nan")  # nothing answered in time: no ratio, no verdict
    new_ratio = new["rate"] / base
    replay_ratio = replays["rate"] / base
    floor_ratio = figures["verify_only"]["rate"] / base
    both_held = held(plain_half, plain_half["target_rate"]) and held(
        new_half, new_half["target_rate"]
    )
    p99_added = new_half["p99_ms"] - plain_half["p99_ms"]
    bound = added_p99_bound(figures)
    p99_ok, why_not = latency_verdict(plain, plain_half, new_half, bound)
    naive_new = figures["naive_new_keys"]["rate"] or float("nan")
    naive_replays = figures["naive_replays"]["rate"] or float("nan")
    figures["ratios"] = {
        "new_keys_vs_naive": new["rate"] / naive_new,
        "replays_vs_naive": replays["rate"] / naive_replays,
        "new_keys_vs_hand_written": new_ratio,
        "replays_vs_hand_written": replay_ratio,
        "verify_only_vs_hand_written": floor_ratio,
        "p99_added_at_half_load_ms": p99_added,
        "p99_bound_ms": bound,
        "paced_rates_held": both_held,
        "p99_verdict": verdict(p99_ok, p99_added),
        "p99_not_measured_because": why_not,
    }
    print(f"\nissue 28, the receiver against the hand-written one ({c} connections, n={n}):")
    print(
        f"  new keys / hand-written: {new_ratio:.2f}x (target >= {NEW_KEYS_TARGET}x): "
        f"{verdict(new_ratio >= NEW_KEYS_TARGET, new_ratio)}"
    )
    print(
        f"  replays / hand-written:  {replay_ratio:.2f}x (target >= {REPLAYS_TARGET}x): "
        f"{verdict(replay_ratio >= REPLAYS_TARGET, replay_ratio)}; verify only, the most "
        f"any replay can reach on this stack: {floor_ratio:.2f}x"
    )
    bound_text = "no commit p99" if bound is None else f"<= {bound:.2f} ms"
    print(
        f"  p99 at half load, receiver minus hand-written: {new_half['p99_ms']:.2f} - "
        f"{plain_half['p99_ms']:.2f} = {p99_added:+.2f} ms (target {bound_text}, 2 x commit "
        f"p99 {commit_p99(figures)} ms + 5 ms): {verdict(p99_ok, p99_added)}"
        + (f" ({why_not})" if why_not else "")
    )
    print(
        f"  against the naive check (no target): new keys "
        f"{figures['ratios']['new_keys_vs_naive']:.2f}x, replays "
        f"{figures['ratios']['replays_vs_naive']:.2f}x"
    )


async def cleanup(
    admin_url: str, db_name: str, broker: str, prefix: str, queues: list[str]
) -> None:
    import asyncpg

    from dedupe.testing.databases import drop_forced
    from dedupe_rabbitmq.admin import delete_channels

    admin = await asyncpg.connect(admin_url)
    try:
        await drop_forced(admin, db_name)  # retried while autovacuum is in it
    finally:
        await admin.close()
    with contextlib.suppress(Exception):
        await delete_channels(broker, [*make_app(prefix=prefix).channels, *queues])


EPILOG = """\
phases, in this order, each bounded by its count and --time-limit-s:
  commit        bench.commit: the machine's durable commit p50/p99 (--commit-n)
  hand-written  bench.apps.hand_written_receiver: verify, publish with confirm, 202
  verify only   bench.apps.verify_only_receiver: the same verify, 202, no publish (the floor)
  new keys      dedupe-worker receive: verify, claim, publish with confirm, store the reply
  replays       the same deliveries again: verify, the stored reply
  naive         bench.apps.naive_receiver: the hand-written one with the check users write
                (one transaction: look the delivery up; publish and remember a new one),
                new deliveries then the same again; no target, the receiver's rates over it
  paced         the hand-written server and the receiver's new keys, open-loop at half of
                their own maximum for --paced-s
verdicts (issue 28): new keys >= 0.8x the hand-written rate; replays >= 2x it; p99 at half
load minus the hand-written one's <= 2 x commit p99 + 5 ms.
Only 127.0.0.1 services; the database and the queues it creates are removed at the end."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.receiver",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument(
        "--requests", type=int, default=3000, help="requests per phase at full speed (3000)"
    )
    parser.add_argument(
        "--connections", type=int, default=32, help="keep-alive connections, every server (32)"
    )
    parser.add_argument(
        "--paced-s",
        type=float,
        default=10,
        help="length of each paced phase at half of a server's maximum (10)",
    )
    parser.add_argument(
        "--time-limit-s", type=float, default=60, help="bound on every phase, in seconds (60)"
    )
    parser.add_argument(
        "--commit-n",
        type=int,
        default=1000,
        help="timed commits of bench.commit for the p99 bound (1000; 0 skips it)",
    )
    parser.add_argument(
        "--database",
        default=os.environ.get(
            "DEDUPE_DATABASE_URL", "postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe"
        ),
        help="an existing database; the benchmark creates and drops its own beside it",
    )
    parser.add_argument(
        "--broker",
        default=os.environ.get("DEDUPE_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/"),
        help="RabbitMQ (every server that publishes)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    args.requests = max(1, min(args.requests, 1_000_000))
    args.connections = max(1, min(args.connections, 1000))
    return args


if __name__ == "__main__":
    parsed = parse()
    result = asyncio.run(main(parsed))
    if parsed.json:
        parsed.json.write_text(json.dumps(result, indent=2) + "\n")
