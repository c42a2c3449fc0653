"""CPU per request of the webhook receiver: both receivers of bench.receiver driven in-process.

    .venv/bin/python -m bench.receiver_core [--n 3000] [--concurrency 32] [--rounds 3]
                                            [--modes hand,receiver] [--profile out.txt]

bench.receiver's two apps, `POST /webhooks/github` with the same GitHub HMAC check, are called as
ASGI apps by `--concurrency` tasks, without uvicorn or sockets, on the real RabbitMQ and a fresh
PostgreSQL database: `hand` is bench.apps.hand_written_receiver (verify, publish with confirms,
202), `receiver` is dedupe's (verify, claim, publish with confirms, store the reply), with `--n`
new deliveries and then the same `--n` again (replays). Reported: this process's CPU time per
request (`time.process_time`: the asyncpg and aio-pika clients' work is in it, PostgreSQL's and
RabbitMQ's is not), which a busy machine disturbs far less than a rate. `--profile` writes
cProfile's top functions of the measured phases (and `<file>.<mode>.prof` for pstats). The
queues and the database are removed at the end. Not in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import statistics
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.http_core import Lifespan, cpu_cprofile, post, timed, write_cprofile  # noqa: E402
from bench.receiver import BODY, GITHUB_SECRET, SIGNATURE  # noqa: E402

MODES = ("hand", "receiver")
DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672/"


async def call(app: Any, state: dict[str, Any], delivery: bytes) -> int:
    """One signed GitHub delivery as uvicorn would pass it; its status."""
    headers = [
        (b"host", b"127.0.0.1:8080"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"x-github-event", b"push"),
        (b"x-github-delivery", delivery),
        (b"x-hub-signature-256", f"sha256={SIGNATURE}".encode()),
    ]
    return await post(app, state, "/webhooks/github", headers, BODY)


async def phase(
    app: Any, state: dict[str, Any], deliveries: list[bytes], concurrency: int
) -> dict[str, Any]:
    """The requests, `concurrency` at a time: CPU µs per request, rate, statuses."""
    return await timed(deliveries, concurrency, lambda delivery: call(app, state, delivery))


def make_app(mode: str, db_url: str, broker: str, prefix: str) -> Any:
    os.environ["GITHUB_WEBHOOK_SECRET"] = GITHUB_SECRET
    if mode == "hand":
        from bench.apps import hand_written_receiver

        os.environ["BENCH_AMQP_URL"] = broker
        os.environ["BENCH_QUEUE"] = f"{prefix}hand-written-github"
        return hand_written_receiver()
    for name, value in {
        "STRIPE_WEBHOOK_SECRET": "whsec_bench",
        "BILLING_WEBHOOK_SECRET": "whsec_YmVuY2g=",
        "ORDERS_API_KEYS": "bench-key=bench",
    }.items():
        os.environ.setdefault(name, value)
    from dedupe_rabbitmq.publisher import RabbitMQPublisher
    from dedupe_receiver.application import create_receiver
    from handlers.webhooks import make_app as webhooks_app

    return create_receiver(
        webhooks_app(prefix=prefix),
        publisher=lambda: RabbitMQPublisher(broker),
        database_url=db_url,
        serve_status=False,
        serve_metrics=False,
    )


async def run_mode(
    mode: str, db_url: str, prefix: str, args: argparse.Namespace, profiler: Any
) -> dict[str, Any]:
    app = make_app(mode, db_url, args.broker, prefix)
    async with Lifespan(app) as life:
        run = uuid.uuid4().hex[:8]
        warm = [f"warm-{run}-{i}".encode() for i in range(300)]
        await phase(app, life.state, warm, args.concurrency)
        await phase(app, life.state, warm, args.concurrency)
        deliveries = [f"{run}-{i}".encode() for i in range(args.n)]
        with profiler(mode) if profiler is not None else contextlib.nullcontext():
            new = await phase(app, life.state, deliveries, args.concurrency)
            replay = await phase(app, life.state, deliveries, args.concurrency)
        return {"new": new, "replay": replay}


async def measure(args: argparse.Namespace, profiler: Any) -> dict[str, Any]:
    from bench.harness import fresh_database
    from dedupe_rabbitmq.admin import delete_channels
    from handlers.webhooks import make_app as webhooks_app

    run = uuid.uuid4().hex[:8]
    prefix = f"bench-core-{run}-"
    rounds: list[dict[str, Any]] = []
    try:
        async with fresh_database() as url:
            for number in range(args.rounds):
                figures = {}
                for mode in args.modes:
                    figures[mode] = await run_mode(mode, url, prefix, args, profiler)
                rounds.append(figures)
                print(json.dumps({"round": number + 1, **figures}), file=sys.stderr)
    finally:
        channels = [*webhooks_app(prefix=prefix).channels, f"{prefix}hand-written-github"]
        with contextlib.suppress(Exception):
            await delete_channels(args.broker, channels)
    medians: dict[str, float] = {}
    for mode in args.modes:
        for kind in ("new", "replay"):
            medians[f"{mode}_{kind}_cpu_us"] = statistics.median(
                r[mode][kind]["cpu_us"] for r in rounds
            )
    import dedupe

    return {"code": str(Path(dedupe.__file__).parent), "n": args.n, "medians": medians}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="hand,receiver", help="of hand, receiver")
    parser.add_argument("--broker", default=os.environ.get("DEDUPE_BROKER_URL", DEFAULT_BROKER))
    parser.add_argument("--asyncio", dest="uvloop", action="store_false", help="no uvloop")
    parser.add_argument("--profile", help="write a cProfile of the measured phases here")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    if not set(args.modes) <= set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    if args.uvloop:
        import uvloop

        uvloop.install()
    profiles: list[tuple[str, cProfile.Profile]] = []

    @contextlib.contextmanager
    def profiled(mode: str) -> Iterator[None]:
        with cpu_cprofile() as profile:
            yield
        profiles.append((mode, profile))

    report = asyncio.run(measure(args, profiled if args.profile else None))
    if args.profile:
        out = io.StringIO()
        for mode, profile in profiles:
            out.write(f"== {mode}: new deliveries then replays\n")
            write_cprofile(profile, out, f"{args.profile}.{mode}.prof")
        Path(args.profile).write_text(out.getvalue())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
