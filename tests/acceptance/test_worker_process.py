"""The real `dedupe-worker` command as a subprocess: crashes, restarts, signals, admin."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

import dedupe_rabbitmq as rabbitmq
from tests.acceptance.conftest import (
    Spawner,
    assert_stopped_cleanly,
    payload,
    run_cli,
    wait_exit,
)
from tests.conftest import eventually


@pytest.fixture
def spawn(spawner: Spawner, amqp_url: str) -> Callable[..., subprocess.Popen[bytes]]:
    """Start a worker on RabbitMQ."""

    def start(*extra: str, lease_s: float = 2.0) -> subprocess.Popen[bytes]:
        return spawner.start(amqp_url, *extra, lease_s=lease_s)

    return start


async def test_kill_9_mid_run_and_restart_loses_nothing_and_runs_each_key_once(
    spawn: Callable[..., subprocess.Popen[bytes]],
    amqp_url: str,
    channel: str,
    effects: asyncpg.Connection,
) -> None:
    """Two workers, one SIGKILLed mid-stream and restarted: every key's effect exactly once."""
    unique = 400
    messages = [(payload(i, sleep_s=0.005), {}, f"k{i}") for i in range(unique)]
    messages += messages[: unique // 3]  # a third published twice
    await rabbitmq.publish(amqp_url, channel, messages)
    victim = spawn(lease_s=1.0)
    spawn(lease_s=1.0)

    async def some_done() -> bool:
        return bool(await effects.fetchval("SELECT count(*) >= 60 FROM effects"))

    await eventually(some_done)
    victim.send_signal(signal.SIGKILL)
    assert await wait_exit(victim) == -signal.SIGKILL
    spawn(lease_s=1.0)

    async def all_done() -> int:
        n = await effects.fetchval("SELECT count(DISTINCT key) FROM effects")
        return bool(n == unique)

    await eventually(all_done, timeout_s=60)
    await asyncio.sleep(1.5)  # let stragglers (deferred copies) settle
    assert await effects.fetchval("SELECT count(*) FROM effects") == unique
    assert (
        await effects.fetchval("SELECT count(*) FROM dedupe_claims WHERE status = 'completed'")
        == unique
    )


async def test_a_message_that_kills_its_worker_is_dead_lettered_after_max_attempts(
    spawn: Callable[..., subprocess.Popen[bytes]],
    amqp_url: str,
    channel: str,
    effects: asyncpg.Connection,
) -> None:
    """Attempts are counted in the claim, so a crash loop ends in the DLQ, not forever."""
    await rabbitmq.publish(
        amqp_url, channel, [(payload(1, crash=True), {}, "poison"), (payload(2), {}, "fine")]
    )
    crashes = 0
    worker = spawn(lease_s=0.5)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 90
    letters: list[dict[str, object]] = []
    while loop.time() < deadline and not letters:
        if worker.poll() is not None:  # it died on the poison message: restart it
            assert worker.returncode == 17
            crashes += 1
            assert crashes <= 3, "the crash loop was not stopped at max_attempts"
            worker = spawn(lease_s=0.5)
        letters = await rabbitmq.peek_dead_letters(amqp_url, channel, limit=5)
        await asyncio.sleep(0.2)
    assert crashes == 3
    assert worker.poll() is None  # the last worker survived: the message is gone
    assert [(d["key"], d["reason"]) for d in letters] == [("poison", "max_attempts_exceeded")]
    assert await effects.fetchval("SELECT count(*) FROM effects WHERE key = 'fine'") == 1


async def test_sigterm_lets_in_flight_work_finish_and_exits_cleanly(
    spawn: Callable[..., subprocess.Popen[bytes]],
    spawner: Spawner,
    amqp_url: str,
    channel: str,
    effects: asyncpg.Connection,
    tmp_path: Path,
) -> None:
    """On SIGTERM the worker stops consuming, completes every run that began, gives back what
    it had claimed but not started (a batch may be claimed just after the signal), and exits 0;
    the messages given back are not lost: the next worker runs each once."""
    await rabbitmq.publish(
        amqp_url, channel, [(payload(i, sleep_s=1.0), {}, f"k{i}") for i in range(4)]
    )
    worker = spawn("--shutdown-timeout-s", "10")

    async def started() -> bool:
        return bool(spawner.started_keys())

    await eventually(started)
    worker.send_signal(signal.SIGTERM)
    assert await wait_exit(worker) == 0
    await assert_stopped_cleanly(effects, spawner.started_keys())
    assert "SIGTERM received" in (tmp_path / "worker-0.log").read_text()

    spawn()

    async def all_done() -> bool:
        return bool(await effects.fetchval("SELECT count(DISTINCT key) = 4 FROM effects"))

    await eventually(all_done, timeout_s=30)
    assert await effects.fetchval("SELECT count(*) FROM effects") == 4


def test_cli_errors_say_what_to_do(db_url: str, tmp_path: Path) -> None:
    """Unknown module, unreachable database, an app without handlers, a missing migration."""
    unknown = run_cli("run", "no_such_module:app", "--database", db_url)
    assert unknown.returncode == 1
    assert "cannot import module 'no_such_module'" in unknown.stderr

    bad_target = run_cli("run", "handlers.payments", "--database", db_url)
    assert bad_target.returncode == 1 and "MODULE:APP" in bad_target.stderr

    down = run_cli("migrate", "--database", "postgresql://dedupe:secret@127.0.0.1:1/x")
    assert down.returncode == 1
    assert "cannot connect to PostgreSQL" in down.stderr and "make services" in down.stderr
    assert "secret" not in down.stderr

    (tmp_path / "empty_app.py").write_text("from dedupe import App\napp = App('empty')\n")
    empty = run_cli("run", "empty_app:app", env={"PYTHONPATH": str(tmp_path)})
    assert empty.returncode == 1 and "has no handlers" in empty.stderr

    invalid = run_cli("run", "handlers.payments:app", "--broker", "http://x")
    assert invalid.returncode == 2 and "broker_url" in invalid.stderr

    # The dead-letter commands on a broker that is not there: the same advice, no traceback.
    for broker in ("amqp://guest:guest@127.0.0.1:1/", "kafka://127.0.0.1:1"):
        gone = run_cli("dlq", "list", "payments", "--broker", broker, "--database", db_url)
        assert gone.returncode == 1, gone.stderr
        assert "cannot reach the broker" in gone.stderr and "make services" in gone.stderr
        assert "Traceback" not in gone.stderr


async def test_run_refuses_an_unmigrated_database(admin_free_db: str) -> None:
    """A worker on a database without the claims table says to run migrate."""
    result = run_cli("run", "handlers.payments:app", "--database", admin_free_db)
    assert result.returncode == 1
    assert "dedupe-worker migrate" in result.stderr


@pytest.fixture
async def admin_free_db(db_url: str) -> str:
    """A database with no dedupe tables at all."""
    conn = await asyncpg.connect(db_url)
    await conn.execute("DROP TABLE dedupe_claims, dedupe_migrations")
    await conn.close()
    return db_url


async def test_migrate_is_idempotent_and_claims_commands_inspect_and_release(
    db_url: str, db: asyncpg.Connection
) -> None:
    """migrate twice is a no-op; claims list/show/release work; release needs --yes off a tty."""
    env = {"DEDUPE_DATABASE_URL": db_url}
    assert "up to date" in run_cli("migrate", env=env).stdout
    await db.execute(
        "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, expires_at)"
        " VALUES ('shop.charge', 'k1', '\\x00', 'failed', 'w', now() + interval '1 day'),"
        "        ('shop.charge', 'k2', '\\x00', 'completed', 'w', now() + interval '1 day')"
    )
    listed = run_cli("claims", "list", "--status", "failed", "--json", env=env)
    assert [row["key"] for row in json.loads(listed.stdout)] == ["k1"]
    shown = run_cli("claims", "show", "shop.charge", "k2", env=env)
    assert json.loads(shown.stdout)["status"] == "completed"

    unconfirmed = run_cli("claims", "release", "shop.charge", "k1", env=env)
    assert unconfirmed.returncode == 1 and "--yes" in unconfirmed.stderr
    released = run_cli("claims", "release", "shop.charge", "k1", "--yes", env=env)
    assert released.returncode == 0 and "was failed" in released.stdout
    refused = run_cli("claims", "release", "shop.charge", "k2", "--yes", env=env)
    assert refused.returncode == 1 and "never released" in refused.stderr
    assert await db.fetchval("SELECT retryable FROM dedupe_claims WHERE key = 'k1'") is True


async def test_a_started_worker_has_frozen_its_start_up_heap(
    spawn: Callable[..., subprocess.Popen[bytes]],
    spawner: Spawner,
    amqp_url: str,
    channel: str,
    effects: asyncpg.Connection,
) -> None:
    """`dedupe-worker run` moves what start-up made (imports, pools, the app) out of the
    collector's reach before its first delivery, so no full collection walks it again."""
    worker = spawn()
    await rabbitmq.publish(amqp_url, channel, [(payload(1), {}, "k1")])

    async def ran() -> bool:
        return spawner.frozen_at_start("k1") is not None

    await eventually(ran, timeout_s=30)
    # Tens of thousands of objects on this code; 0 if the worker never froze its heap.
    assert (spawner.frozen_at_start("k1") or 0) > 5_000
    worker.send_signal(signal.SIGTERM)
    assert await wait_exit(worker) == 0
