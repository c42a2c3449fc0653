"""A fencing token is never issued twice, on RabbitMQ and on Kafka, with real worker processes.

A zombie is frozen (SIGSTOP) in a key's first run, so it holds the key's first token; its lease
lapses and another worker takes a copy of the message over and completes it; an operator purges
the finished claim (`dedupe-worker claims purge`) and the message is published again, so a
worker claims the key afresh; the zombie is resumed (SIGCONT) while that fresh run is under way.
Were tokens counted per row, the fresh claim would get the zombie's token back and the zombie's
writes would pass the fence.

Who sleeps: the first run to start while the slow fuse exists (tests/apps/chaos.py,
CHAOS_SLOW_FUSE). The test lays it before the first publish (that run is the zombie) and again
before the replay (that run is the fresh one, still sleeping when the zombie wakes).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest

from tests.apps.chaos import SCHEMA, SCOPE
from tests.chaos.brokers import ChaosKafka, ChaosRabbit
from tests.chaos.conftest import LEASE_S, record
from tests.chaos.harness import ROOT, Probe, Report, Workers, wait_drained
from tests.conftest import AMQP_URL, KAFKA_URL

T = TypeVar("T")

# A frozen Kafka consumer leaves its group after the session timeout (6 s: the broker's least
# by default, group.min.session.timeout.ms) and its partitions move to the other worker.
BROKERS: dict[str, Callable[[], ChaosRabbit | ChaosKafka]] = {
    "rabbitmq": lambda: ChaosRabbit(AMQP_URL),
    "kafka": lambda: ChaosKafka(KAFKA_URL, session_timeout_ms=6000),
}
KEY = "token-0000001"
MESSAGE = (json.dumps({"id": KEY, "v": 1}).encode(), {"X-Tenant": "t-a"}, KEY)
# The slow runs sleep this long: past the moment the test freezes the first one; short of the
# Kafka transport's revoke timeout (min(--shutdown-timeout-s 5, 10)), so that the rebalance the
# resumed zombie causes waits for the fresh run instead of abandoning it.
SLOW_S = 3.0
STEP_S = 60.0  # every wait of the scenario is bounded by this


async def until(what: str, probe: Callable[[], Awaitable[T | None]], within_s: float = STEP_S) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = await probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within {within_s:.0f}s")


def taken_by(fuse: Path, *, besides: set[int]) -> Callable[[], Awaitable[int | None]]:
    """The pid of the worker that took `fuse` (`<fuse>.taken-by-<pid>`), other than `besides`."""

    async def probe() -> int | None:
        pids = {int(path.name.rsplit("-", 1)[1]) for path in fuse.parent.glob(f"{fuse.name}.*")}
        return min(pids - besides, default=None)

    return probe


async def claim(db: asyncpg.Connection) -> dict[str, Any] | None:
    row = await db.fetchrow(
        "SELECT status, token, owner, lease_until < now() AS lapsed FROM dedupe_claims"
        " WHERE scope = $1 AND key = $2",
        f"{SCOPE}/t-a",
        KEY,
    )
    return dict(row) if row is not None else None


async def purge(db_url: str) -> str:
    """`dedupe-worker claims purge` of every finished claim of the handler, as an operator would."""
    argv = ["claims", "purge", "--older-than-s", "0", "--scope", SCOPE, "--yes"]
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "dedupe.cli", *argv, "--database", db_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("broker", list(BROKERS))
async def test_a_zombie_holding_a_purged_keys_first_token_writes_nothing_after_a_fresh_claim(
    broker: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """Frozen in a key's first run, taken over, purged, re-claimed and then resumed, the zombie
    writes nothing: the fresh claim's token is not the one it holds."""
    chaos = BROKERS[broker]()
    fuse = tmp_path / "slow.fuse"
    env = {
        "DEDUPE_DATABASE_URL": db_url,
        "DEDUPE_BROKER_URL": chaos.worker_url(channel),
        "DEDUPE_GC_INTERVAL_S": "0",
        # One unacknowledged message per RabbitMQ consumer: the frozen zombie's slot is full,
        # so the copies published later go to the other worker.
        "DEDUPE_PREFETCH": "1",
        "CHAOS_CHANNEL": channel,
        "CHAOS_LEASE_S": str(LEASE_S),
        "CHAOS_SLOW_FUSE": str(fuse),
        "CHAOS_SLOW_S": str(SLOW_S),
    }
    db = await asyncpg.connect(db_url)
    await db.execute(SCHEMA)
    workers = Workers(env, tmp_path, concurrency=2)
    began = time.monotonic()
    publishes = 0
    try:
        workers.start()
        workers.start()

        async def both_consume() -> bool:
            return await chaos.consumers(channel) == 2

        await until("both workers consuming", both_consume)

        fuse.touch()
        await chaos.publish(channel, [MESSAGE])
        publishes += 1
        zombie = await until("the first run started", taken_by(fuse, besides=set()))
        zombie_proc = next(proc for proc in workers.procs if proc.pid == zombie)
        zombie_proc.send_signal(signal.SIGSTOP)
        first = await until("the first claim", lambda: claim(db))
        assert first["status"] == "in_progress", first

        async def lapsed() -> bool:
            row = await claim(db)
            return bool(row and row["lapsed"])

        await until("the zombie's lease lapsed", lapsed)
        if broker == "rabbitmq":
            # The zombie keeps its delivery until its connection dies: send another copy.
            await chaos.publish(channel, [MESSAGE])
            publishes += 1

        async def taken_over_and_completed() -> dict[str, Any] | None:
            row = await claim(db)
            return row if row and row["status"] == "completed" else None

        taken_over = await until("the take-over completed", taken_over_and_completed)
        purged = await purge(db_url)
        assert purged == "purged 1 claim(s)", purged
        assert await claim(db) is None

        fuse.touch()
        await chaos.publish(channel, [MESSAGE])  # the message replayed
        publishes += 1
        fresh_pid = await until("the fresh run started", taken_by(fuse, besides={zombie}))
        fresh = await claim(db)
        assert fresh is not None and fresh["status"] == "in_progress", fresh
        zombie_proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()

        async def settled() -> bool:
            row = await claim(db)
            return bool(row and row["status"] == "completed")

        await until("the key completed again", settled)
        drain_s = await wait_drained(
            Probe(db_url), lambda: chaos.backlog(channel), 1, within_s=LEASE_S + 30
        )
        drain_s = max(drain_s, time.monotonic() - resumed)
        exits = [proc.returncode for proc in workers.procs if proc.poll() is not None]
    finally:
        workers.stop()
    try:
        effects = await db.fetch(
            "SELECT pid, count(*) AS n FROM chaos_effects WHERE business_key = $1 GROUP BY pid",
            KEY,
        )
        external_keys = await db.fetchval(
            "SELECT count(DISTINCT idempotency_key) FROM chaos_external WHERE business_key = $1",
            KEY,
        )
        final = await claim(db)
    finally:
        await db.close()
    by_pid = {row["pid"]: row["n"] for row in effects}
    tokens = (
        f"tokens: first {first['token']}, take-over {taken_over['token']}, fresh {fresh['token']}"
    )
    problems: list[str] = []
    if by_pid.get(zombie):
        problems.append(f"the zombie (pid {zombie}) wrote {by_pid[zombie]} effect(s); {tokens}")
    # One effect by the take-over and one by the fresh run (a purged key runs again: that is
    # what a purge means), none by the zombie.
    others = sum(n for pid, n in by_pid.items() if pid != zombie)
    if others != 2:
        problems.append(
            f"{others} effects by the other workers, not 2 (a take-over, then a fresh run by pid "
            f"{fresh_pid}); {tokens}"
        )
    if final is None or final["status"] != "completed":
        problems.append(f"the key ended {final}")
    if exits:
        problems.append(f"workers exited: {exits}")
    await record(
        Report(
            scenario=f"{broker}: zombie resumed after a purge and a fresh claim of its key",
            messages=publishes,
            duplicates=publishes - 1,
            faults=1,
            lost=0 if final is not None and final["status"] == "completed" else 1,
            duplicated_effects=by_pid.get(zombie, 0),
            external_keys_differing=int(external_keys != 1),
            drain_s=drain_s,
            total_s=time.monotonic() - began,
            problems=problems,
        )
    )
    assert not problems, problems
