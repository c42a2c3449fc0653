"""`dedupe-worker gc` cleans the outbox too: beside workers run with --gc-interval-s 0 (which
clean nothing), the documented cron command keeps the outbox bounded; `status` shows the lag."""

from __future__ import annotations

import asyncio

import asyncpg

from tests.acceptance.conftest import Spawner
from tests.acceptance.test_admin_commands import cli
from tests.conftest import eventually
from tests.integration.test_outbox_cleanup import ROWS, left


async def test_gc_keeps_the_outbox_bounded_beside_workers_that_never_clean_up(
    spawner: Spawner, amqp_url: str, db_url: str, effects: asyncpg.Connection
) -> None:
    """A worker with --gc-interval-s 0 leaves sent rows past their retention; `status` says
    how long they have waited; `dedupe-worker gc` deletes them and keeps the unsent row."""
    worker = spawner.start(amqp_url, "--gc-interval-s", "0")

    async def started() -> bool:
        """The worker's pool is connected (it holds connections to the test's database)."""
        others = await effects.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return bool(others) or worker.poll() is not None

    await eventually(started, timeout_s=30)
    assert worker.poll() is None
    await effects.execute(ROWS)
    await asyncio.sleep(1.0)  # the worker's relay runs; its clean-up is off
    assert len(await left(effects)) == 4
    status = await cli(db_url, "status")
    assert status.returncode == 0, status.stderr
    assert "sent rows past their retention waiting 864" in status.stdout  # a day, in seconds
    cleaned = await cli(db_url, "gc")
    assert cleaned.returncode == 0, cleaned.stderr
    assert "deleted 0 expired claim(s) and 2 sent outbox row(s)" in cleaned.stdout
    assert await left(effects) == ["kept", "unsent"]
    again = await cli(db_url, "gc")
    assert "and 0 sent outbox row(s)" in again.stdout
