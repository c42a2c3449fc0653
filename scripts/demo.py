"""`make demo`: the main job end to end on real services.

Two workers consume a burst of payment requests with duplicates, key conflicts, invalid and
poison messages; one worker is killed with SIGKILL mid-run and restarted; the summary shows
what ran once and the SQL that proves it. Then the HTTP API section (scripts/demo_http.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from handlers.payments import app, setup  # noqa: E402

ADMIN_URL = os.environ.get(
    "DEDUPE_DATABASE_URL", "postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe"
)
AMQP_URL = os.environ.get("DEDUPE_DEMO_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
KAFKA_URL = os.environ.get("DEDUPE_DEMO_KAFKA_URL", "kafka://127.0.0.1:9092")
DEMO_DB = "dedupe_demo"
CHANNEL = "payments"
LOGS = ROOT / ".services" / "demo"
LEASE_S = max(handler.lease_s for handler in app.handlers.values())


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def demo_url() -> str:
    return ADMIN_URL.rpartition("/")[0] + "/" + DEMO_DB


def workload(
    seed: int, unique: int, duplicates: int, conflicts: int, invalid: int, poison: int
) -> list[tuple[bytes, dict[str, Any], str | None]]:
    """Valid payments and their duplicates shuffled, then the conflicts and the bad ones."""
    rng = random.Random(seed)
    valid: list[tuple[bytes, dict[str, Any], str | None]] = [
        (
            json.dumps(
                {"payment_id": f"pay-{i:05d}", "customer": f"cus-{i % 37}", "amount_cents": 100 + i}
            ).encode(),
            {},
            f"req-{i:05d}",
        )
        for i in range(unique)
    ]
    burst = valid + [rng.choice(valid) for _ in range(duplicates)]
    rng.shuffle(burst)
    for i in rng.sample(range(unique), conflicts):  # same key, another amount
        burst.append(
            (
                json.dumps(
                    {"payment_id": f"pay-{i:05d}", "customer": "cus-x", "amount_cents": 999_999}
                ).encode(),
                {},
                f"req-{i:05d}",
            )
        )
    for i in range(invalid):
        burst.append((b'{"payment_id": "broken", ' + str(i).encode(), {}, f"bad-{i}"))
    for i in range(poison):
        burst.append(
            (
                json.dumps(
                    {"payment_id": f"poison-{i}", "customer": "cus-p", "amount_cents": 1}
                ).encode(),
                {},
                f"poison-{i}",
            )
        )
    return burst


class Rabbit:
    name = "RabbitMQ"
    url = AMQP_URL

    async def reset(self) -> None:
        import aio_pika

        from consumers.rabbitmq import declare_channel

        connection = await aio_pika.connect(self.url)
        async with connection:
            amqp = await connection.channel()
            await declare_channel(amqp, CHANNEL)
            for name in (CHANNEL, f"{CHANNEL}.dlq", f"{CHANNEL}.delay"):
                await (await amqp.get_queue(name)).purge()

    async def publish(self, messages: list[tuple[bytes, dict[str, Any], str | None]]) -> None:
        from consumers.rabbitmq import publish

        await publish(self.url, CHANNEL, messages)

    async def dead_letters(self) -> Counter[str]:
        from consumers.rabbitmq import peek_dead_letters

        letters = await peek_dead_letters(self.url, CHANNEL, limit=1000)
        return Counter(str(letter["reason"]) for letter in letters)

    async def backlog(self) -> int:
        import aio_pika

        connection = await aio_pika.connect(self.url)
        async with connection:
            amqp = await connection.channel()
            total = 0
            for name in (CHANNEL, f"{CHANNEL}.delay"):
                queue = await amqp.declare_queue(name, passive=True)
                total += int(queue.declaration_result.message_count or 0)
            return total


def make_broker(kind: str) -> Any:
    if kind == "rabbitmq":
        return Rabbit()
    if kind == "kafka":
        from scripts.demo_kafka import Kafka

        return Kafka(KAFKA_URL, CHANNEL)
    sys.exit(f"demo: unknown broker {kind!r} (rabbitmq or kafka)")


class Workers:
    """`dedupe-worker run handlers.payments:app` processes with their logs in .services/demo."""

    def __init__(self, broker_url: str, metrics_port: int = 0) -> None:
        self.broker_url = broker_url
        self.metrics_port = metrics_port  # worker n serves /metrics on metrics_port + n
        self.procs: list[subprocess.Popen[bytes]] = []
        LOGS.mkdir(parents=True, exist_ok=True)

    def start(self) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        env = {
            **os.environ,
            "DEDUPE_DATABASE_URL": demo_url(),
            "DEDUPE_BROKER_URL": self.broker_url,
            "DEDUPE_STATS_INTERVAL_S": "1",
            "DEDUPE_WORKER_NAME": f"demo-worker-{n}",
            "DEDUPE_METRICS_PORT": str(self.metrics_port + n if self.metrics_port else 0),
            "DEDUPE_METRICS_INTERVAL_S": "1",
        }
        log = open(LOGS / f"worker-{n}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dedupe.cli",
                "run",
                "handlers.payments:app",
                "--concurrency",
                "16",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def save_metrics(self) -> list[Path]:
        """Each live worker's /metrics, saved next to its log (before the workers stop)."""
        saved = []
        for n, proc in enumerate(self.procs):
            if not self.metrics_port or proc.poll() is not None:
                continue
            url = f"http://127.0.0.1:{self.metrics_port + n}/metrics"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as reply:
                path = LOGS / f"metrics-worker-{n}.txt"
                path.write_bytes(reply.read())
                saved.append(path)
        return saved

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def run(args: argparse.Namespace) -> int:
    broker = make_broker(args.broker)
    say(f"database {DEMO_DB} (fresh), broker {broker.name}, channel '{CHANNEL}'")
    admin = await asyncpg.connect(ADMIN_URL)
    await admin.execute(f"DROP DATABASE IF EXISTS {DEMO_DB} WITH (FORCE)")
    await admin.execute(f"CREATE DATABASE {DEMO_DB}")
    await admin.close()
    await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "dedupe.cli", "migrate", "--database", demo_url()],
        cwd=ROOT,
        check=True,
    )
    await setup(demo_url())
    await broker.reset()

    burst = workload(
        args.seed, args.unique, args.duplicates, args.conflicts, args.invalid, args.poison
    )
    workers = Workers(broker.url, args.metrics_port)
    workers.start()
    workers.start()
    say(f"two workers started (logs in {LOGS.relative_to(ROOT)}/)")
    began = time.monotonic()
    await broker.publish(burst)
    say(f"published {len(burst)} messages")
    db = await asyncpg.connect(demo_url())
    try:
        deadline = time.monotonic() + args.timeout_s
        first_charge: float | None = None  # the workers' start-up is not throughput
        while (charged := await db.fetchval("SELECT count(*) FROM charges")) < args.kill_after:
            if charged and first_charge is None:
                first_charge = time.monotonic()
            if time.monotonic() > deadline:
                say("timed out before the crash point; see the worker logs")
                return 1
            await asyncio.sleep(0.02)
        victim = workers.procs[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed_at = await db.fetchval("SELECT count(*) FROM charges")
        crashed = time.monotonic()
        orphaned = await db.fetchval(
            "SELECT count(*) FROM dedupe_claims"
            " WHERE status = 'in_progress' AND owner = 'demo-worker-0'"
        )
        say(
            f"SIGKILLed worker 0 at {killed_at} charges ({orphaned} of its claims left in"
            " progress); restarting it"
        )
        workers.start()

        expected_dead = args.conflicts + args.invalid + args.poison
        while True:
            charges = await db.fetchval("SELECT count(*) FROM charges")
            in_progress = await db.fetchval(
                "SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress'"
            )
            dead = await broker.dead_letters()
            backlog = await broker.backlog()
            if (
                charges >= args.unique
                and not in_progress
                and not backlog
                and sum(dead.values()) >= expected_dead
            ):
                break
            if time.monotonic() > deadline:
                say(
                    f"timed out: charges={charges} in_progress={in_progress} backlog={backlog} "
                    f"dead={dict(dead)}"
                )
                return 1
            await asyncio.sleep(0.25)
        elapsed = time.monotonic() - began
        await asyncio.sleep(1.5)  # one more round of the claims-table gauges
        metrics_files = await asyncio.to_thread(workers.save_metrics)
        workers.stop()
        charges, distinct = await db.fetchrow(
            "SELECT count(*), count(DISTINCT payment_id) FROM charges"
        )
        calls, call_keys = await db.fetchrow(
            "SELECT count(*), count(DISTINCT idempotency_key) FROM provider_calls"
            " WHERE payment_id NOT LIKE 'poison-%'"
        )
        statuses = dict(
            await db.fetch("SELECT status, count(*) FROM dedupe_claims GROUP BY status")
        )
        suppressed = await db.fetchval(
            "SELECT coalesce(sum(duplicates), 0) FROM dedupe_scope_counts"
        )
    finally:
        workers.stop()
        await db.close()

    ok = charges == distinct == args.unique and call_keys == args.unique
    ok = ok and dead == Counter(
        {
            "key_conflict": args.conflicts,
            "invalid_payload": args.invalid,
            "max_attempts_exceeded": args.poison,
        }
    )
    width = 30
    rows = [
        (
            "published",
            f"{len(burst)}  ({args.unique} unique payments, {args.duplicates} duplicates,"
            f" {args.conflicts} same-key-other-payload, {args.invalid} invalid JSON,"
            f" {args.poison} poison)",
        ),
        ("unique valid messages", f"{args.unique}"),
        (
            "side effects (charges rows)",
            f"{charges}  ({distinct} distinct payments)"
            + ("  == unique valid messages" if charges == args.unique else "  !! MISMATCH"),
        ),
        (
            "provider calls",
            f"{calls} over {call_keys} distinct idempotency keys"
            " (a repeat after the crash carries the same key)",
        ),
        (
            "duplicates suppressed",
            f"{suppressed}  ({args.duplicates} duplicate copies published; counts are flushed"
            " every 5 s: the killed worker's last ones are lost, a copy seen again after"
            " the crash counts twice)",
        ),
        ("dead-lettered", ", ".join(f"{k} {v}" for k, v in sorted(dead.items()))),
        ("claims", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))),
        ("crash", f"worker 0 SIGKILLed at {killed_at} charges and restarted"),
        (
            "throughput",
            f"{killed_at / (crashed - (first_charge or began)):.0f} charges/s over two workers"
            f" from the first charge to the crash ({killed_at} in"
            f" {crashed - (first_charge or began):.1f} s)",
        ),
        (
            "recovery",
            f"{orphaned} claims of the killed worker taken over once their {LEASE_S:.0f} s lease"
            " expired (fencing keeps a late completion out)",
        ),
        ("time", f"{elapsed:.1f} s in all for {len(burst)} messages, the lease wait included"),
    ]
    print()
    print(f"dedupe-worker demo on {broker.name}: summary")
    for label, value in rows:
        print(f"  {label:<{width}} {value}")
    print()
    print("verify it yourself:")
    print(f'  psql {demo_url()} -c "SELECT count(*), count(DISTINCT payment_id) FROM charges"')
    print(f'  psql {demo_url()} -c "SELECT status, count(*) FROM dedupe_claims GROUP BY 1"')
    print(f'  psql {demo_url()} -c "SELECT count(DISTINCT idempotency_key) FROM provider_calls"')
    print(f"  .venv/bin/dedupe-worker dlq list {CHANNEL} --broker {broker.url}")
    print(f"  DEDUPE_DATABASE_URL={demo_url()} .venv/bin/dedupe-worker status")
    for path in metrics_files:
        print(f"  grep ^dedupe_ {path.relative_to(ROOT)}  # a worker's /metrics before it stopped")
    print()
    print(
        "RESULT: " + ("every valid payment charged exactly once" if ok else "MISMATCH, see above")
    )
    http_ok = await http_api_section()
    return 0 if ok and http_ok else 1


async def http_api_section() -> bool:
    """An orders API behind IdempotencyMiddleware: one order per key (scripts/demo_http.py)."""
    from demo_http import run_http_demo  # scripts/ is on sys.path: this file runs as a script

    return await run_http_demo(demo_url(), LOGS)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--broker", default="rabbitmq", choices=["rabbitmq", "kafka"])
    parser.add_argument("--unique", type=int, default=680)
    parser.add_argument("--duplicates", type=int, default=300)
    parser.add_argument("--conflicts", type=int, default=10)
    parser.add_argument("--invalid", type=int, default=5)
    parser.add_argument("--poison", type=int, default=5)
    parser.add_argument("--kill-after", type=int, default=340, help="charges before the SIGKILL")
    parser.add_argument("--timeout-s", type=float, default=180)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9100,
        help="worker n serves /metrics on this + n; 0 = off",
    )
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
