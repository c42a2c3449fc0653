"""`make demo`: the main job end to end on real services.

Two workers consume a burst of payment requests with duplicates, key conflicts, invalid and
poison messages; one worker is killed with SIGKILL mid-run and restarted; the summary shows
what ran once and the SQL that proves it: the charges, the provider calls (a durable step: the
runs the SIGKILL interrupted do not call again once their call is recorded) and the receipts
(stage 2: published through the outbox, relayed to `receipts`, handled once each). Then the
HTTP API section (scripts/demo_http.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dedupe.testing.databases import drop_forced  # noqa: E402
from handlers.payments import RECEIPTS, app, setup  # noqa: E402
from scripts.demo_workers import CHANNEL, LOGS, Workers, make_broker  # noqa: E402

ADMIN_URL = os.environ.get(
    "DEDUPE_DATABASE_URL", "postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe"
)
AMQP_URL = os.environ.get("DEDUPE_DEMO_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
KAFKA_URL = os.environ.get("DEDUPE_DEMO_KAFKA_URL", "kafka://127.0.0.1:9092")
DEMO_DB = "dedupe_demo"
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


async def run(args: argparse.Namespace) -> int:
    broker = make_broker(args.broker, amqp_url=AMQP_URL, kafka_url=KAFKA_URL)
    say(f"database {DEMO_DB} (fresh), broker {broker.name}, channels '{CHANNEL}', '{RECEIPTS}'")
    admin = await asyncpg.connect(ADMIN_URL)
    await drop_forced(admin, DEMO_DB)  # retried while autovacuum is in it
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
    workers = Workers(broker.url, demo_url(), args.metrics_port)
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
        # The payments the SIGKILL interrupted, with the token of the run it killed.
        orphans = {
            r["key"]: r["token"]
            for r in await db.fetch(
                "SELECT key, token FROM dedupe_claims WHERE status = 'in_progress'"
                " AND owner = 'demo-worker-0' AND scope = 'shop.charge'"
            )
        }
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
            receipts = await db.fetchval("SELECT count(*) FROM receipts")
            unsent = await db.fetchval("SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL")
            in_progress = await db.fetchval(
                "SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress'"
            )
            dead = await broker.dead_letters()
            backlog = await broker.backlog()
            if (
                charges >= args.unique
                and receipts >= args.unique
                and not unsent
                and not in_progress
                and not backlog
                and sum(dead.values()) >= expected_dead
            ):
                break
            if time.monotonic() > deadline:
                say(
                    f"timed out: charges={charges} receipts={receipts} unsent={unsent} "
                    f"in_progress={in_progress} backlog={backlog} dead={dict(dead)}"
                )
                return 1
            await asyncio.sleep(0.25)
        elapsed = time.monotonic() - began
        await asyncio.sleep(1.5)  # one more round of the claims-table gauges
        metrics_files = await asyncio.to_thread(workers.save_metrics)
        workers.stop()
        figures = await measure(db, orphans)
    finally:
        workers.stop()
        await db.close()

    charges, distinct = figures["charges"], figures["distinct_payments"]
    calls, call_keys = figures["calls"], figures["call_keys"]
    receipts, receipt_payments = figures["receipts"], figures["receipt_payments"]
    ok = charges == distinct == args.unique and call_keys == args.unique
    # A provider call repeats only for a payment the SIGKILL interrupted inside the call.
    ok = ok and figures["repeats_elsewhere"] == 0
    ok = ok and receipts == receipt_payments == figures["outbox_rows"] == args.unique
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
            f"{calls} over {call_keys} distinct idempotency keys: once per payment"
            + (
                f", but {figures['repeats']} called again (killed inside the call, same key)"
                if figures["repeats"]
                else ""
            ),
        ),
        (
            "  the runs the SIGKILL cut",
            f"{len(orphans)} payments: {figures['answered_by_step']} had their provider call"
            " recorded by the step and did not call again on the re-run,"
            f" {figures['repeats']} were inside the call, the others had not called yet",
        ),
        (
            "receipts (stage 2)",
            f"{receipts}  ({receipt_payments} distinct payments)"
            + ("  == unique valid messages" if receipts == args.unique else "  !! MISMATCH"),
        ),
        (
            "  through the outbox",
            f"{figures['outbox_rows']} rows stored with the charges, all relayed (lag p50"
            f" {figures['lag_p50_s']:.2f} s, max {figures['lag_max_s']:.2f} s);"
            f" {figures['receipt_duplicates']} receipt duplicates acked without a second run",
        ),
        (
            "duplicates suppressed",
            f"{figures['suppressed']}  ({args.duplicates} duplicate copies published; counts are"
            " flushed every 5 s: the killed worker's last ones are lost, a copy seen again after"
            " the crash counts twice)",
        ),
        ("dead-lettered", ", ".join(f"{k} {v}" for k, v in sorted(dead.items()))),
        ("claims", ", ".join(f"{k} {v}" for k, v in sorted(figures["statuses"].items()))),
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
    print(f'  psql {demo_url()} -c "SELECT count(*), count(DISTINCT payment_id) FROM receipts"')
    print(f'  psql {demo_url()} -c "SELECT count(*), count(sent_at) FROM dedupe_outbox"')
    print(f"  .venv/bin/dedupe-worker dlq list {CHANNEL} --broker {broker.url}")
    print(f"  DEDUPE_DATABASE_URL={demo_url()} .venv/bin/dedupe-worker status")
    for path in metrics_files:
        print(f"  grep ^dedupe_ {path.relative_to(ROOT)}  # a worker's /metrics before it stopped")
    print()
    print(
        "RESULT: "
        + (
            "every valid payment charged exactly once, its receipt sent once"
            if ok
            else "MISMATCH, see above"
        )
    )
    http_ok = await http_api_section()
    return 0 if ok and http_ok else 1


async def measure(db: asyncpg.Connection, orphans: dict[str, int]) -> dict[str, Any]:
    """The summary's figures, from the demo database once everything settled."""
    figures: dict[str, Any] = {}
    figures["charges"], figures["distinct_payments"] = await db.fetchrow(
        "SELECT count(*), count(DISTINCT payment_id) FROM charges"
    )
    calls = {
        r["key"]: r["n"]
        for r in await db.fetch(
            "SELECT idempotency_key AS key, count(*) AS n FROM provider_calls"
            " WHERE payment_id NOT LIKE 'poison-%' GROUP BY 1"
        )
    }
    figures["calls"], figures["call_keys"] = sum(calls.values()), len(calls)
    # The step's idempotency key is `<claim key>/charge`.
    repeated = {key.removesuffix("/charge") for key, n in calls.items() if n > 1}
    figures["repeats"] = len(repeated & orphans.keys())
    figures["repeats_elsewhere"] = len(repeated - orphans.keys())
    figures["answered_by_step"] = await db.fetchval(
        "SELECT count(*) FROM dedupe_steps s JOIN unnest($1::text[], $2::bigint[]) AS o(key, token)"
        " ON s.scope = 'shop.charge' AND s.key = o.key AND s.token = o.token",
        list(orphans),
        list(orphans.values()),
    )
    figures["receipts"], figures["receipt_payments"] = await db.fetchrow(
        "SELECT count(*), count(DISTINCT payment_id) FROM receipts"
    )
    row = await db.fetchrow(
        "SELECT count(*) AS n,"
        " coalesce(percentile_cont(0.5) WITHIN GROUP"
        "  (ORDER BY extract(epoch FROM sent_at - created_at)), 0) AS p50,"
        " coalesce(max(extract(epoch FROM sent_at - created_at)), 0) AS max"
        " FROM dedupe_outbox WHERE channel = $1",
        RECEIPTS,
    )
    figures["outbox_rows"], figures["lag_p50_s"], figures["lag_max_s"] = (
        row["n"],
        float(row["p50"]),
        float(row["max"]),
    )
    figures["statuses"] = dict(
        await db.fetch("SELECT status, count(*) FROM dedupe_claims GROUP BY status")
    )
    counts = dict(await db.fetch("SELECT scope, duplicates FROM dedupe_scope_counts"))
    figures["suppressed"] = counts.get("shop.charge", 0)
    figures["receipt_duplicates"] = counts.get("shop.receipt", 0)
    return figures


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
