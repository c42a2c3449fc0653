"""What the acceptance tests share: real `dedupe-worker` processes and their logs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from tests.conftest import CHECKOUT_PATH, ROOT

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
        self.started = logs / "started"  # a file per key whose handler began (tests/apps/crashy.py)
        self.started.mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []

    def started_keys(self) -> set[str]:
        """The keys whose handler has begun to run, in any worker so far."""
        return {urllib.parse.unquote(path.name) for path in self.started.iterdir()}

    def frozen_at_start(self, key: str) -> int | None:
        """gc.get_freeze_count() in the worker whose handler began to run `key`; None before
        that handler has begun (or while its file is being written)."""
        path = self.started / urllib.parse.quote(key, safe="")
        text = path.read_text() if path.exists() else ""
        return int(text) if text else None

    def start(self, broker_url: str, *extra: str, lease_s: float = 2.0) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "DEDUPE_DATABASE_URL": self.db_url,
            "DEDUPE_BROKER_URL": broker_url,
            "DEDUPE_STATS_INTERVAL_S": "1",
            "CRASHY_CHANNEL": self.channel,
            "CRASHY_LEASE_S": str(lease_s),
            "CRASHY_STARTED_DIR": str(self.started),
            "PYTHONPATH": CHECKOUT_PATH,
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


async def assert_stopped_cleanly(effects: asyncpg.Connection, began: set[str]) -> list[str]:
    """After a graceful stop: every run that began was completed (its effect once), and every
    other claim was given back (in progress, its lease ended, marked handed back) for the next
    worker to take at once. Returns the completed keys."""
    claims = await effects.fetch(
        "SELECT key, status, lease_until <= now() AS released, error FROM dedupe_claims"
    )
    completed = sorted(c["key"] for c in claims if c["status"] == "completed")
    assert began and began <= set(completed), (began, completed)
    for claim in claims:
        if claim["status"] != "completed":
            assert claim["status"] == "in_progress", dict(claim)
            assert claim["released"] and claim["error"] == "handed back", dict(claim)
    assert sorted(r["key"] for r in await effects.fetch("SELECT key FROM effects")) == completed
    return completed


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


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    """Headless Chromium through chromedriver (Debian's packages: `make browser`)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.fail("chromium and chromedriver are missing: run `make browser`")
    profile = tempfile.mkdtemp(prefix="dedupe-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    try:
        yield chrome
    finally:
        chrome.quit()
        shutil.rmtree(profile, ignore_errors=True)
