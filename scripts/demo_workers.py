"""What `make demo` (scripts/demo.py) runs on: the RabbitMQ side of its channels and the
`dedupe-worker run handlers.payments:app` processes (the Kafka side is scripts/demo_kafka.py).

The demo's channels: `payments` (the burst) and `receipts` (stage 2, fed by the outbox).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from handlers.payments import RECEIPTS

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / ".services" / "demo"
CHANNEL = "payments"
CHANNELS = (CHANNEL, RECEIPTS)


class Rabbit:
    """The demo's channels on RabbitMQ: reset, publish, dead letters, backlog."""

    name = "RabbitMQ"

    def __init__(self, url: str) -> None:
        self.url = url

    async def reset(self) -> None:
        import aio_pika

        from dedupe_rabbitmq.topology import declare_channel, delay_queues

        connection = await aio_pika.connect(self.url)
        async with connection:
            amqp = await connection.channel()
            for channel in CHANNELS:
                await declare_channel(amqp, channel)
                for name in (channel, f"{channel}.dlq", *delay_queues(channel)):
                    await (await amqp.get_queue(name)).purge()

    async def publish(self, messages: list[tuple[bytes, dict[str, Any], str | None]]) -> None:
        from dedupe_rabbitmq.admin import publish

        await publish(self.url, CHANNEL, messages)

    async def dead_letters(self) -> Counter[str]:
        from dedupe_rabbitmq.admin import peek_dead_letters

        letters = await peek_dead_letters(self.url, CHANNEL, limit=1000)
        return Counter(str(letter["reason"]) for letter in letters)

    async def backlog(self) -> int:
        """Messages waiting in both channels (and their delay queues)."""
        import aio_pika

        from dedupe_rabbitmq.topology import delay_queues

        connection = await aio_pika.connect(self.url)
        async with connection:
            amqp = await connection.channel()
            total = 0
            for channel in CHANNELS:
                for name in (channel, *delay_queues(channel)):
                    queue = await amqp.declare_queue(name, passive=True)
                    total += int(queue.declaration_result.message_count or 0)
            return total


def make_broker(kind: str, *, amqp_url: str, kafka_url: str) -> Any:
    if kind == "rabbitmq":
        return Rabbit(amqp_url)
    if kind == "kafka":
        from scripts.demo_kafka import Kafka

        return Kafka(kafka_url, CHANNEL, RECEIPTS)
    sys.exit(f"demo: unknown broker {kind!r} (rabbitmq or kafka)")


class Workers:
    """`dedupe-worker run handlers.payments:app` processes with their logs in .services/demo."""

    def __init__(self, broker_url: str, database_url: str, metrics_port: int = 0) -> None:
        self.broker_url = broker_url
        self.database_url = database_url
        self.metrics_port = metrics_port  # worker n serves /metrics on metrics_port + n
        self.procs: list[subprocess.Popen[bytes]] = []
        LOGS.mkdir(parents=True, exist_ok=True)

    def start(self) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        env = {
            **os.environ,
            "DEDUPE_DATABASE_URL": self.database_url,
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
