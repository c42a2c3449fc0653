"""The real `dedupe-worker` command on Kafka: kill -9 mid-batch, a crash between completion and
the offset commit, and a graceful stop that commits what it finished."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

import dedupe_kafka as kafka
from tests.acceptance.conftest import (
    Spawner,
    assert_stopped_cleanly,
    final_stats,
    payload,
    wait_exit,
)
from tests.conftest import eventually


@pytest.fixture
def group_url(kafka_url: str) -> str:
    """The broker URL with a consumer group of this test's own (the CLI's default group is
    named after the app, which other tests' workers share)."""
    return kafka.with_options(
        kafka_url, group_id=f"t-{uuid.uuid4().hex[:10]}", session_timeout_ms=6000
    )


@pytest.fixture
def spawn(spawner: Spawner, group_url: str) -> Callable[..., subprocess.Popen[bytes]]:
    """Start a worker on Kafka in this test's group; URL options may be added per worker."""

    def start(*extra: str, lease_s: float = 2.0, **url_options: object) -> subprocess.Popen[bytes]:
        return spawner.start(kafka.with_options(group_url, **url_options), *extra, lease_s=lease_s)

    return start


async def test_kill_9_mid_batch_and_restart_loses_nothing_and_runs_each_key_once(
    spawn: Callable[..., subprocess.Popen[bytes]],
    spawner: Spawner,
    group_url: str,
    channel: str,
    effects: asyncpg.Connection,
) -> None:
    """Two workers in one group, one SIGKILLed mid-stream (with claims in flight) and
    restarted: each key's effect once, and the group's committed offsets reach the end.

    The victim starts alone on the first half of the stream; the second half is published once
    its peer has partitions, so the victim still has work then, however long the join took.
    Both take batches of 32: the group rebalances at once (group.initial.rebalance.delay.ms=0)
    and a member gives up a partition only once the batches it holds are done, so with the
    default window (64 at the spawner's concurrency of 8, four batches held per partition) the
    first member to join held the whole stream and the other saw only duplicates (CI of b191c54:
    the victim joined second and never held a claim)."""
    unique = 800
    messages = [(payload(i, sleep_s=0.05), {}, f"k{i}") for i in range(unique)]
    messages += messages[: unique // 3]  # a third published twice
    first, second = messages[: len(messages) // 2], messages[len(messages) // 2 :]
    await kafka.publish(group_url, channel, first)
    in_flight = "SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress' AND owner = $1"
    ran = "SELECT count(*) FROM dedupe_claims WHERE status = 'completed' AND owner = $1"
    window = ("--prefetch", "32")
    victim = spawn(*window, lease_s=1.0)
    victim_name = f"{socket.gethostname()}:{victim.pid}"  # the worker's default name

    async def holds(name: str) -> bool:
        return bool(await effects.fetchval(in_flight, name))

    await eventually(lambda: holds(victim_name))
    peer = spawn(*window, lease_s=1.0)
    peer_name = f"{socket.gethostname()}:{peer.pid}"
    peer_log = spawner.logs / f"worker-{len(spawner.procs) - 1}.log"

    async def peer_assigned() -> bool:
        return f"assigned {channel}[" in await asyncio.to_thread(peer_log.read_text)

    await eventually(peer_assigned, timeout_s=60)
    await kafka.publish(group_url, channel, second)

    async def victim_busy() -> bool:
        # Both in the group (the peer has completed keys), the victim with claims in flight.
        return bool(await effects.fetchval(ran, peer_name) and await holds(victim_name))

    await eventually(victim_busy, timeout_s=30)
    victim.send_signal(signal.SIGKILL)
    assert await wait_exit(victim) == -signal.SIGKILL
    # It died mid-batch: keys it had claimed are still in progress under its name (nobody
    # takes them over before its session and their leases lapse).
    assert await effects.fetchval(in_flight, victim_name) > 0
    spawn(lease_s=1.0)

    async def all_done() -> int:
        n = await effects.fetchval("SELECT count(DISTINCT key) FROM effects")
        return bool(n == unique)

    await eventually(all_done, timeout_s=90)
    group_id = kafka.KafkaOptions.from_url(group_url).group_id

    async def committed() -> bool:
        return await kafka.backlog(group_url, channel, group_id) == 0

    await eventually(committed, timeout_s=30)
    assert await effects.fetchval("SELECT count(*) FROM effects") == unique
    assert (
        await effects.fetchval("SELECT count(*) FROM dedupe_claims WHERE status = 'completed'")
        == unique
    )


async def test_a_crash_after_completion_but_before_the_offset_commit_yields_acked_duplicates(
    spawn: Callable[..., subprocess.Popen[bytes]],
    group_url: str,
    channel: str,
    effects: asyncpg.Connection,
    tmp_path: Path,
) -> None:
    """Outcomes recorded, offsets not committed, worker killed: the next worker reads every
    message again and acknowledges each as a duplicate without running the handler."""
    count = 50
    await kafka.publish(group_url, channel, [(payload(i), {}, f"k{i}") for i in range(count)])
    group_id = kafka.KafkaOptions.from_url(group_url).group_id
    crasher = spawn(commit_interval_s=3600)  # it would commit only on revocation or shutdown

    async def all_completed() -> bool:
        return bool(
            await effects.fetchval(
                "SELECT count(*) = $1 FROM dedupe_claims WHERE status = 'completed'", count
            )
        )

    await eventually(all_completed)
    assert await kafka.backlog(group_url, channel, group_id) == count  # nothing committed
    crasher.send_signal(signal.SIGKILL)
    assert await wait_exit(crasher) == -signal.SIGKILL

    successor = spawn()

    async def committed() -> bool:
        return await kafka.backlog(group_url, channel, group_id) == 0

    await eventually(committed, timeout_s=60)
    successor.send_signal(signal.SIGTERM)
    assert await wait_exit(successor) == 0
    stats = final_stats(tmp_path / "worker-1.log")
    assert (stats["completed"], stats["duplicates"]) == (0, count)
    assert await effects.fetchval("SELECT count(*) FROM effects") == count


async def test_sigterm_finishes_in_flight_work_commits_it_and_leaves_the_group(
    spawn: Callable[..., subprocess.Popen[bytes]],
    spawner: Spawner,
    group_url: str,
    channel: str,
    effects: asyncpg.Connection,
    tmp_path: Path,
) -> None:
    """On SIGTERM the worker completes every run that began, gives back what it claimed but
    had not started, commits the offsets of what finished, and exits 0."""
    await kafka.publish(
        group_url, channel, [(payload(i, sleep_s=1.0), {}, f"k{i}") for i in range(4)]
    )
    group_id = kafka.KafkaOptions.from_url(group_url).group_id
    worker = spawn("--shutdown-timeout-s", "10", commit_interval_s=3600)

    async def started() -> bool:
        return bool(spawner.started_keys())

    await eventually(started)
    worker.send_signal(signal.SIGTERM)
    assert await wait_exit(worker) == 0
    # Each partition claims its own batch: one claimed just after the signal is given back.
    finished = len(await assert_stopped_cleanly(effects, spawner.started_keys()))
    # The shutdown commit covers exactly what finished (the partitions run independently).
    assert await kafka.backlog(group_url, channel, group_id) == 4 - finished
    assert "SIGTERM received" in (tmp_path / "worker-0.log").read_text()
