"""What the acceptance tests share: real `dedupe-worker` processes and their logs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import ROOT

CLI = [sys.executable, "-m", "dedupe.cli"]


@pytest.fixture
async def effects(db: asyncpg.Connection) -> asyncpg.Connection:
    """The table tests/apps/crashy.py writes one row per run into."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL, pid int)")
    return db


class Spawner:
    """Starts `dedupe-worker run tests.apps.crashy:app` processes; kills leftovers on close."""

    def __init__(self, db_url: str, channel: str, logs: Path) -> None:
        self.db_url, self.channel, self.logs = db_url, channel, logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, broker_url: str, *extra: str, lease_s: float = 2.0) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "DEDUPE_DATABASE_URL": self.db_url,
            "DEDUPE_BROKER_URL": broker_url,
            "DEDUPE_STATS_INTERVAL_S": "1",
            "CRASHY_CHANNEL": self.channel,
            "CRASHY_LEASE_S": str(lease_s),
            "PYTHONPATH": str(ROOT),
        }
        log = open(self.logs / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [*CLI, "run", "tests.apps.crashy:app", "--concurrency", "8", *extra],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def spawner(db_url: str, channel: str, tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(db_url, channel, tmp_path)
    yield spawner
    spawner.close()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `dedupe-worker ARGS` to completion, without a terminal."""
    return subprocess.run(
        [*CLI, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


async def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout_s)


def payload(n: int, **extra: object) -> bytes:
    return json.dumps({"n": n, **extra}).encode()


def final_stats(log: Path) -> dict[str, object]:
    """The counters a worker logs when it stops."""
    lines = [line for line in log.read_text().splitlines() if "stopped;" in line]
    assert lines, log.read_text()[-2000:]
    stats: dict[str, object] = json.loads(lines[-1][lines[-1].index("{") :])
    return stats
