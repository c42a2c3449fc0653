"""Benchmark of the webhook receiver: requests/s and latency of a real `dedupe-worker receive`.

    .venv/bin/python bench/receiver.py [--requests 5000] [--connections 32] [--time-limit-s 60]

Starts `dedupe-worker receive bench.receiver:app` on 127.0.0.1 with a fresh database and
channels of its own, drives it with a small keep-alive HTTP/1.1 load generator (asyncio
streams, so the client costs little of the CPU it shares with the server), and prints
requests/s with p50/p90/p99 latency for new keys (claim + publish with confirms + store the
reply) and for replays (claim finds the reply, replays it). The database and the queues are
removed at the end. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from handlers.webhooks import make_app  # noqa: E402

GITHUB_SECRET = "bench-only-secret"  # a fixed, fake secret: this process signs, it receives

# The app the receiver process loads (`bench.receiver:app`); its channels carry the prefix
# the benchmark passes down, so that they are its own and can be deleted afterwards.
app = make_app(prefix=os.environ.get("BENCH_CHANNEL_PREFIX", "bench-"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request_bytes(port: int, body: bytes, signature: str, delivery: str) -> bytes:
    head = (
        f"POST /webhooks/github HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"X-GitHub-Event: push\r\nX-GitHub-Delivery: {delivery}\r\n"
        f"X-Hub-Signature-256: sha256={signature}\r\n\r\n"
    )
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 response (Content-Length framed); return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.lower() == "content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


async def run_phase(
    port: int, keys: list[str], *, connections: int, deadline: float
) -> tuple[list[float], dict[int, int], float]:
    """Send one request per key over `connections` keep-alive connections."""
    body = json.dumps({"ref": "refs/heads/main", "commits": [{"id": "c0ffee"}] * 5}).encode()
    signature = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for key in keys:
        queue.put_nowait(key)
    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not queue.empty() and time.monotonic() < deadline:
                key = queue.get_nowait()
                started = time.perf_counter()
                writer.write(request_bytes(port, body, signature, key))
                await writer.drain()
                status = await read_response(reader)
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(connections)))
    return latencies, statuses, time.perf_counter() - started


def report(name: str, latencies: list[float], statuses: dict[int, int], elapsed: float) -> None:
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    print(
        f"{name:<9} {len(ms):>6} req in {elapsed:6.2f}s  {len(ms) / elapsed:8.0f} req/s  "
        f"p50 {q[49]:6.2f} ms  p90 {q[89]:6.2f} ms  p99 {q[98]:6.2f} ms  "
        f"max {ms[-1]:7.2f} ms  statuses {dict(sorted(statuses.items()))}"
    )


async def wait_ready(port: int, proc: asyncio.subprocess.Process, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise SystemExit(f"the receiver exited with {proc.returncode}")
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            status = await read_response(reader)
            writer.close()
            if status == 200:
                return
        await asyncio.sleep(0.2)
    raise SystemExit("the receiver did not become ready")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="per phase (default 5000)")
    parser.add_argument("--connections", type=int, default=32, help="concurrent (default 32)")
    parser.add_argument("--time-limit-s", type=float, default=60, help="per phase (default 60)")
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
    )
    args = parser.parse_args()

    import asyncpg

    from dedupe.claims.database import migrate

    run = uuid.uuid4().hex[:8]
    db_name = f"dedupe_bench_{run}"
    base, _, _ = args.database.rpartition("/")
    db_url = f"{base}/{db_name}"
    prefix = f"bench-{run}-"
    admin = await asyncpg.connect(args.database)
    await admin.execute(f"CREATE DATABASE {db_name}")
    await admin.close()
    port = free_port()
    proc: asyncio.subprocess.Process | None = None
    try:
        await migrate(db_url)
        env = {
            **os.environ,
            "DEDUPE_DATABASE_URL": db_url,
            "DEDUPE_BROKER_URL": args.broker,
            "DEDUPE_LOG_LEVEL": "WARNING",
            "BENCH_CHANNEL_PREFIX": prefix,
            "GITHUB_WEBHOOK_SECRET": GITHUB_SECRET,
            "STRIPE_WEBHOOK_SECRET": "whsec_bench",
            "BILLING_WEBHOOK_SECRET": "whsec_YmVuY2g=",
            "ORDERS_API_KEYS": "bench-key=bench",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "consumers")]),
        }
        command = [sys.executable, "-m", "dedupe.cli", "receive", "bench.receiver:app"]
        proc = await asyncio.create_subprocess_exec(
            *command, "--port", str(port), cwd=ROOT, env=env
        )
        await wait_ready(port, proc)
        print(
            f"dedupe-worker receive on 127.0.0.1:{port}, {args.connections} connections, "
            f"{args.requests} requests per phase, POST /webhooks/github (HMAC verified)"
        )
        warm = [f"warm-{i}" for i in range(min(500, args.requests))]
        await run_phase(port, warm, connections=args.connections, deadline=time.monotonic() + 30)
        keys = [f"{run}-{i}" for i in range(args.requests)]
        deadline = time.monotonic() + args.time_limit_s
        report(
            "new keys",
            *await run_phase(port, keys, connections=args.connections, deadline=deadline),
        )
        deadline = time.monotonic() + args.time_limit_s
        report(
            "replays", *await run_phase(port, keys, connections=args.connections, deadline=deadline)
        )
    finally:
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await cleanup(args.database, db_name, args.broker, prefix)
    return 0


async def cleanup(admin_url: str, db_name: str, broker: str, prefix: str) -> None:
    import asyncpg

    from dedupe.testing.databases import drop_forced
    from dedupe_rabbitmq.admin import delete_channels

    admin = await asyncpg.connect(admin_url)
    try:
        await drop_forced(admin, db_name)  # retried while autovacuum is in it
    finally:
        await admin.close()
    with contextlib.suppress(Exception):
        await delete_channels(broker, make_app(prefix=prefix).channels)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
