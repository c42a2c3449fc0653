"""A third-party transport is a package with an entry point: the in-repo example
(tests/plugins/example_transport, JSON-lines files in a directory) is installed with pip into a
directory of its own and found by `dedupe-worker run --broker example://...` through its
`dedupe.transports` entry point, with nothing of it imported by dedupe or named in our
pyproject.toml. pip builds it in an isolated environment (it fetches setuptools, as a user's
install would)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.acceptance.conftest import CLI, final_stats, wait_exit
from tests.conftest import CHECKOUT_PATH, ROOT, eventually

EXAMPLE = ROOT / "tests" / "plugins" / "example_transport"

APP = """\
import os

from dedupe import App, Context

app = App("example")


@app.handler("orders")
async def place(body: bytes, ctx: Context) -> dict:
    await ctx.db.execute(
        "INSERT INTO effects (key, n, pid) VALUES ($1, 1, $2)", ctx.key, os.getpid()
    )
    return {"placed": ctx.key}
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example installed with `pip install --target` (the dev venv stays as it is)."""
    source = tmp_path_factory.mktemp("source") / "example_transport"
    # pip builds in the source tree: a copy keeps build/ and *.egg-info out of the checkout.
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    result = subprocess.run(
        [*pip, "--no-deps", "--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (entry_points,) = target.glob("dedupe_example_transport-*.dist-info/entry_points.txt")
    assert "example = dedupe_example_transport:plugin" in entry_points.read_text()
    return target


def line(message_id: str, n: int) -> str:
    return json.dumps({"body": json.dumps({"n": n}), "message_id": message_id}) + "\n"


def settlements(broker: Path) -> list[dict[str, object]]:
    path = broker / "settlements.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(row) for row in text.splitlines()]


@pytest.fixture
def worker(
    installed: Path, db_url: str, effects: asyncpg.Connection, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """`dedupe-worker run example_app:app --broker example://<dir>`, with the example
    transport importable from its install alone; yields the process, the dir and the log."""
    broker, project = tmp_path / "broker", tmp_path / "project"
    broker.mkdir()
    project.mkdir()
    (project / "example_app.py").write_text(APP)
    log_path = tmp_path / "worker.log"
    env = {
        **os.environ,
        # The example's install, then the checkout (for dedupe, as the dev venv has it).
        "PYTHONPATH": os.pathsep.join([str(installed), CHECKOUT_PATH]),
        "DEDUPE_STATS_INTERVAL_S": "0",
    }
    command = [*CLI, "run", "example_app:app", "--broker", f"example://{broker}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, "--database", db_url, "--shutdown-timeout-s", "5"],
            cwd=project,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield proc, broker, log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


async def test_a_handler_runs_on_a_transport_installed_by_entry_point(
    worker: tuple[subprocess.Popen[bytes], Path, Path], effects: asyncpg.Connection
) -> None:
    """The real `dedupe-worker run` on example://: once per key, a redelivered message acked as
    a duplicate (the transport's outcome file says so), then a graceful stop on SIGTERM."""
    proc, broker, log_path = worker
    orders = broker / "orders.jsonl"
    orders.write_text(line("order-1", 1) + line("order-2", 2))

    async def settled(count: int) -> list[dict[str, object]] | None:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        rows = settlements(broker)
        return rows if len(rows) >= count else None

    first = await eventually(lambda: settled(2), timeout_s=30)
    assert {(r["message_id"], r["action"], r["duplicate"]) for r in first} == {
        ("order-1", "ack", False),
        ("order-2", "ack", False),
    }
    with orders.open("a") as file:  # the broker delivers order-1 again
        file.write(line("order-1", 1))
    rows = await eventually(lambda: settled(3), timeout_s=30)
    assert (rows[2]["message_id"], rows[2]["action"], rows[2]["duplicate"]) == (
        "order-1",
        "ack",
        True,
    )
    assert "order-1" in str(rows[2]["result"])  # the stored outcome, replayed

    keys = [r["key"] for r in await effects.fetch("SELECT key FROM effects ORDER BY key")]
    assert keys == ["order-1", "order-2"]  # the handler ran once per key

    proc.send_signal(signal.SIGTERM)
    assert await wait_exit(proc, 30) == 0
    assert final_stats(log_path)["duplicates"] == 1
    assert "SIGTERM received" in log_path.read_text()
