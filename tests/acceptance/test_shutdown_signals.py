"""SIGINT on a real `dedupe-worker run` process whose handlers outlast --shutdown-timeout-s."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import asyncpg

import dedupe_rabbitmq as rabbitmq
from tests.acceptance.conftest import Spawner, payload, wait_exit
from tests.conftest import eventually
from tests.integration.brokers import RabbitBroker


async def in_progress(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress'"))


async def held(db: asyncpg.Connection) -> int:
    """Keys whose lease still holds: a worker that gave its keys back holds none."""
    return int(
        await db.fetchval(
            "SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress'"
            " AND lease_until > now()"
        )
    )


async def attempts_counted(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT coalesce(sum(attempts), 0) FROM dedupe_claims"))


async def started(worker: subprocess.Popen[bytes], db: asyncpg.Connection, count: int) -> None:
    """Wait until the worker runs `count` handlers (so its signal handlers are installed)."""

    async def running() -> bool:
        assert worker.poll() is None, "the worker stopped before it ran anything"
        return await in_progress(db) == count

    await eventually(running)


async def test_sigint_past_the_timeout_gives_messages_back_and_a_second_worker_runs_each_once(
    spawner: Spawner,
    amqp_url: str,
    channel: str,
    effects: asyncpg.Connection,
    tmp_path: Path,
) -> None:
    """Handlers sleep 4 s, the grace period is 0.5 s: the worker exits 0 without waiting for
    them, with no effect written, its keys given back and its messages back in the queue;
    another worker then runs each of them exactly once."""
    count, sleep_s = 3, 4.0
    await rabbitmq.publish(
        amqp_url, channel, [(payload(i, sleep_s=sleep_s), {}, f"k{i}") for i in range(count)]
    )
    first = spawner.start(amqp_url, "--shutdown-timeout-s", "0.5")
    await started(first, effects, count)

    first.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    assert await wait_exit(first, timeout_s=15) == 0
    assert time.monotonic() - signalled < sleep_s, "it waited for the handlers"
    assert "SIGINT received" in (tmp_path / "worker-0.log").read_text()
    assert await effects.fetchval("SELECT count(*) FROM effects") == 0
    assert await held(effects) == 0  # the keys were given back, not left to lapse
    assert await attempts_counted(effects) == 0  # and the interrupted attempts not counted
    assert await RabbitBroker(amqp_url).backlog(channel) == count

    second = spawner.start(amqp_url)

    async def all_done() -> bool:
        return bool(await effects.fetchval("SELECT count(*) = $1 FROM effects", count))

    await eventually(all_done, timeout_s=15)
    second.send_signal(signal.SIGTERM)
    assert await wait_exit(second) == 0
    runs = await effects.fetch(
        "SELECT key, count(*) AS n, min(pid) AS pid FROM effects GROUP BY key"
    )
    assert sorted((r["key"], r["n"]) for r in runs) == [(f"k{i}", 1) for i in range(count)]
    assert {r["pid"] for r in runs} == {second.pid}
    completed = "SELECT count(*) FROM dedupe_claims WHERE status = 'completed'"
    assert await effects.fetchval(completed) == count


async def test_a_second_sigint_during_the_grace_period_stops_the_worker_at_once(
    spawner: Spawner,
    amqp_url: str,
    channel: str,
    effects: asyncpg.Connection,
    tmp_path: Path,
) -> None:
    """With 30 s of grace and handlers of 30 s, the first SIGINT waits; the second gives the
    messages back and the worker exits 0 within seconds."""
    count = 2
    await rabbitmq.publish(
        amqp_url, channel, [(payload(i, sleep_s=30.0), {}, f"k{i}") for i in range(count)]
    )
    worker = spawner.start(amqp_url, "--shutdown-timeout-s", "30")
    await started(worker, effects, count)

    worker.send_signal(signal.SIGINT)
    await asyncio.sleep(1.0)
    assert worker.poll() is None, "the first signal did not wait for in-flight handlers"
    worker.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    assert await wait_exit(worker, timeout_s=15) == 0
    assert time.monotonic() - signalled < 5.0
    assert "second signal" in (tmp_path / "worker-0.log").read_text()
    assert await effects.fetchval("SELECT count(*) FROM effects") == 0
    assert await held(effects) == 0
    assert await RabbitBroker(amqp_url).backlog(channel) == count
