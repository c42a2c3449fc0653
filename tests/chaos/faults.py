"""Faults, injected at progress milestones so that they spread over the whole run."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.harness import Probe, Workers
from tests.chaos.workload import Workload

PG_CLUSTER = ["15", "main"]
# The last fault of a scenario lands when at most this many keys are left to settle.
LAST_FAULT_LEFT = 1000
SERVICES = str(Path(__file__).resolve().parents[2] / "scripts" / "services.sh")


@dataclass
class Run:
    """What a fault needs: the workers, a probe, the workload and how many faults to inject."""

    workers: Workers
    probe: Probe
    workload: Workload
    faults: int
    lease_s: float
    worker_count: int = 2
    timeout_s: float = 600.0
    unexpected_exits: int = 0

    def milestone(self, i: int) -> int:
        """How many keys are settled when fault i of k happens: spread evenly from 1/(k+1) of
        the keys to the last fault, which lands when k/(k+1) are settled or when at most
        LAST_FAULT_LEFT keys are left, whichever is later, so that what follows it is the
        fault's recovery, which the drain check bounds, not the rest of a large run. Only keys
        that get a claim count (hostile keys and tenants never settle)."""
        n, k = self.workload.claimed, self.faults
        last = max(k / (k + 1), 1 - LAST_FAULT_LEFT / n)
        first = 1 / (k + 1) if k > 1 else last
        fraction = first + (last - first) * i / (k - 1) if k > 1 else last
        return int(n * fraction)

    async def milestones(self) -> AsyncIterator[int]:
        """Yield i = 0..faults-1 when self.milestone(i) keys are settled."""
        deadline = time.monotonic() + self.timeout_s
        for i in range(self.faults):
            target = self.milestone(i)
            while await self.probe.settled() < target:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no progress to milestone {i} within {self.timeout_s}s")
                self.keep_workers()
                await asyncio.sleep(0.05)
            yield i

    def keep_workers(self, **env: str) -> None:
        """Restart workers that died without being told to (and count them)."""
        for proc in self.workers.reap():
            if proc.returncode not in (-signal.SIGKILL,):
                self.unexpected_exits += 1
        while len(self.workers.alive) < self.worker_count:
            self.workers.start(**env)


Fault = Callable[[Run], Awaitable[int]]


async def kill_at_random(run: Run) -> int:
    """kill -9 a random worker at each milestone, then start a new one."""
    kills = 0
    async for _ in run.milestones():
        victim = random.choice(run.workers.alive)
        await asyncio.sleep(random.uniform(0, 0.3))  # a random moment, not a quiet one
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
        kills += 1
        run.keep_workers()
    return kills


def kill_at_failpoint(stage: str) -> Fault:
    """At each milestone a fuse is laid; the first worker to pass `stage` takes it and
    SIGKILLs itself (tests/apps/chaos.py); a new worker replaces it."""

    async def inject(run: Run) -> int:
        fuse = run.workers.logs / "failpoint.fuse"
        run.workers.env.update({"CHAOS_FAILPOINT": stage, "CHAOS_FUSE": str(fuse)})
        async for _ in run.milestones():
            fuse.touch()
            deadline = time.monotonic() + 60  # bounded: the stream may have nothing left
            while fuse.exists() and time.monotonic() < deadline:
                run.keep_workers()
                await asyncio.sleep(0.02)
            if fuse.exists():  # nothing passed the failpoint in a minute: the stream is over
                fuse.unlink()
                break
        run.keep_workers()
        # A worker that took a fuse has killed itself; keep_workers checked it died by SIGKILL.
        return len(list(fuse.parent.glob(f"{fuse.name}.taken-by-*")))

    return inject


async def freeze_past_the_lease(run: Run) -> int:
    """SIGSTOP a worker for 2.5 leases, then SIGCONT: its completions must be fenced off."""
    freezes = 0
    async for _ in run.milestones():
        victim = random.choice(run.workers.alive)
        victim.send_signal(signal.SIGSTOP)
        await asyncio.sleep(run.lease_s * 2.5)
        victim.send_signal(signal.SIGCONT)
        freezes += 1
    return freezes


def _command(*argv: str) -> Callable[[], Awaitable[None]]:
    async def execute() -> None:
        done = await asyncio.to_thread(
            subprocess.run, list(argv), timeout=180, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
            )

    return execute


async def restart_rabbitmq(run: Run) -> int:
    """Stop the RabbitMQ node (the Erlang VM exits; durable queues stay) and start it again."""
    restarts = 0
    async for _ in run.milestones():
        await _command("bash", SERVICES, "down", "rabbitmq")()
        await asyncio.sleep(1.0)
        await _command("bash", SERVICES, "up", "rabbitmq")()
        restarts += 1
    return restarts


async def restart_postgres(run: Run) -> int:
    """Restart PostgreSQL (fast shutdown: every session is cut) under the workers."""
    restarts = 0
    async for _ in run.milestones():
        await _command(
            "pg_ctlcluster", "--skip-systemctl-redirect", *PG_CLUSTER, "restart", "-m", "fast"
        )()
        restarts += 1
    return restarts


async def restart_kafka(run: Run) -> int:
    """Stop the Kafka broker (SIGTERM, then its data stays) and start it again."""
    restarts = 0
    async for _ in run.milestones():
        await _command("bash", SERVICES, "down", "kafka")()
        await asyncio.sleep(1.0)
        await _command("bash", SERVICES, "up", "kafka")()
        restarts += 1
    return restarts


async def scale_consumers(run: Run) -> int:
    """Consumers of one group scaled 1 -> 3 -> 2 during the stream (two rebalances)."""
    run.worker_count = 1
    run.keep_workers()
    changes = 0
    async for i in run.milestones():
        if i == 0:
            run.worker_count = 3
            run.keep_workers()
        else:
            leaving = run.workers.alive[0]
            run.worker_count = 2
            leaving.send_signal(signal.SIGTERM)
            await asyncio.to_thread(leaving.wait, 60)
            run.workers.reap()
        changes += 1
    return changes


async def terminate_backends(run: Run) -> int:
    """pg_terminate_backend every worker session, in the middle of their commits."""
    rounds = 0
    async for _ in run.milestones():
        for _ in range(3):
            await run.probe.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'dedupe-worker'"
            )
            await asyncio.sleep(0.1)
        rounds += 1
    return rounds


CLUSTER = str(Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh")


def fail_over_postgres(*, lag_s: float = 0.0) -> Fault:
    """Kill -9 the PostgreSQL primary of scripts/cluster.sh (every process at once, as a machine
    dies) and promote its standby; the workers' URL lists both hosts with
    target_session_attrs=read-write, so their next connections find the new primary. `lag_s`:
    the standby's WAL receiver is frozen that long before the kill (a standby that lags)."""

    async def fault(run: Run) -> int:
        failovers = 0
        async for _ in run.milestones():
            await _command("bash", CLUSTER, "pg-failover", str(lag_s))()
            failovers += 1
        return failovers

    return fault


def kill_cluster_leader(service: str, name: str) -> Fault:
    """kill -9 the node of scripts/cluster.sh's `service` (`kafka` or `rabbitmq`) that leads
    `name` (the channel's topic, or its quorum queue) and wait until another node leads it
    (`cluster.sh kafka-kill-leader` / `rabbitmq-kill-leader`), then start the node again
    (`cluster.sh up`, which waits until it is back in the cluster; Kafka's: until every
    partition's replicas are in sync), so that the next kill leaves a majority. The workers'
    URL lists the three nodes; what they see is a leader that dies under them."""

    async def fault(run: Run) -> int:
        kills = 0
        async for _ in run.milestones():
            await _command("bash", CLUSTER, f"{service}-kill-leader", name)()
            kills += 1
            run.keep_workers()
            await _command("bash", CLUSTER, "up", service)()
        return kills

    return fault
