"""Chaos on the network between the workers and a service: the workload runs while a TCP fault
proxy (tests/chaos/proxy.py) makes the path to PostgreSQL, or to RabbitMQ, slow, stalled or cut.

- latency: every worker reaches the service through the proxy, 5 ms each way, and the workers
  are killed (-9) at random at each milestone, so recovery runs on the slow path too;
- a stall past the lease: one more worker reaches the service through a proxy of its own, which
  swallows everything either way (the connection left open) for 2.5 leases at each milestone,
  then delivers it late. The other workers take its keys over meanwhile: what it sends when the
  path heals (completions, heartbeats, acks) must be fenced off or harmless, and it must not hang;
- a cut: the same worker's connections are reset at each milestone: it reconnects by itself.

Kafka's path is not proxied: its clients bootstrap through any address, then connect to the
advertised listener. Its rows put the proxy in front of PostgreSQL only.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos import faults
from tests.chaos.brokers import ChaosKafka, ChaosRabbit
from tests.chaos.conftest import FAULTS, SIZE, run_scenario
from tests.chaos.faults import Fault, Run
from tests.chaos.proxy import FaultProxy
from tests.conftest import AMQP_URL, KAFKA_URL

BROKERS = {"rabbitmq": lambda: ChaosRabbit(AMQP_URL), "kafka": lambda: ChaosKafka(KAFKA_URL)}
SERVICE_URLS = {"PostgreSQL": "DEDUPE_DATABASE_URL", "RabbitMQ": "DEDUPE_BROKER_URL"}
LATENCY_S = 0.005
# make test's size keeps these rows short (three faults each; a stall costs 2.5 leases); the
# large run (make chaos) takes CHAOS_FAULTS.
NETWORK_FAULTS = FAULTS if SIZE > 2000 else min(FAULTS, 3)
# A worker told to stop exits within this, whatever its network does.
STOP_WITHIN_S = 30.0


def slow_path(service: str) -> Fault:
    """Every worker through a proxy adding LATENCY_S each way; kill -9 at random meanwhile."""
    variable = SERVICE_URLS[service]

    async def inject(run: Run) -> int:
        url = run.workers.env[variable]
        async with FaultProxy.of_url(url) as proxy:
            proxy.latency(LATENCY_S)
            run.workers.env[variable] = proxy.url_for(url)
            try:
                kills = await faults.kill_at_random(run)
                # The drain runs after this returns: the proxy must outlive the workers' use
                # of it, so the workers move back to the direct path first.
                run.workers.env[variable] = url
                await _replace_workers(run)
            finally:
                run.workers.env[variable] = url
            assert proxy.connections > 0, "no worker went through the proxy"
        return kills

    return inject


def one_workers_path(service: str, kind: str) -> Fault:
    """One more worker through a proxy of its own; at each milestone its path is stalled for
    2.5 leases then healed (`stall`), or cut (`cut`). At the end it stops by SIGTERM (for
    `stall`, with its path stalled again) and must exit cleanly within its bounds: a worker that
    crashed or hung on the faulty path is a problem."""
    variable = SERVICE_URLS[service]

    async def inject(run: Run) -> int:
        url = run.workers.env[variable]
        injected = 0
        async with FaultProxy.of_url(url) as proxy:
            victim = run.workers.start(**{variable: proxy.url_for(url)})
            try:
                async for _ in run.milestones():
                    if victim.poll() is not None:
                        break
                    if kind == "stall":
                        proxy.stall()
                        await asyncio.sleep(run.lease_s * 2.5)
                        proxy.resume()
                    else:
                        proxy.cut()
                    injected += 1
                if kind == "stall" and victim.poll() is None:
                    # Stopped while its path is stalled: bounded by its own timeouts, not the
                    # network's return.
                    proxy.stall()
            finally:
                await _stop(run, victim)
                proxy.heal()
                proxy.resume()
            assert proxy.connections > 0, "the worker never went through the proxy"
        return injected

    return inject


async def _stop(run: Run, victim: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker on the faulty path and forget it; count it if it had died or does
    not stop cleanly within its shutdown timeout."""
    run.workers.procs = [proc for proc in run.workers.procs if proc is not victim]
    if victim.poll() is not None:
        run.unexpected_exits += 1
        return
    victim.send_signal(signal.SIGTERM)
    try:  # --shutdown-timeout-s 5, then statements bounded by their own timeouts
        code = await asyncio.to_thread(victim.wait, STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        victim.kill()
        await asyncio.to_thread(victim.wait, 10)
        run.unexpected_exits += 1
        return
    if code != 0:
        run.unexpected_exits += 1


async def _replace_workers(run: Run) -> None:
    """Stop the workers (gracefully) and start new ones with the current environment."""
    old = list(run.workers.alive)
    run.workers.procs = [proc for proc in run.workers.procs if proc not in old]
    for proc in old:
        proc.send_signal(signal.SIGTERM)
    for proc in old:
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
    run.keep_workers()


SCENARIOS: dict[tuple[str, str], Callable[[], Fault]] = {
    ("PostgreSQL", "5 ms each way, kill -9 at random"): lambda: slow_path("PostgreSQL"),
    ("PostgreSQL", "one worker's path stalled past the lease"): lambda: one_workers_path(
        "PostgreSQL", "stall"
    ),
    ("PostgreSQL", "one worker's path cut"): lambda: one_workers_path("PostgreSQL", "cut"),
    ("RabbitMQ", "5 ms each way, kill -9 at random"): lambda: slow_path("RabbitMQ"),
    ("RabbitMQ", "one worker's path stalled past the lease"): lambda: one_workers_path(
        "RabbitMQ", "stall"
    ),
    ("RabbitMQ", "one worker's path cut"): lambda: one_workers_path("RabbitMQ", "cut"),
}

CASES = [
    pytest.param(broker, service, name, id=f"{broker}-{service}: {name}")
    for broker in BROKERS
    for service, name in SCENARIOS
    if not (broker == "kafka" and service == "RabbitMQ")
]


@pytest.mark.parametrize(("broker", "service", "name"), CASES)
async def test_a_network_that_misbehaves_loses_nothing_and_does_nothing_twice(
    broker: str, service: str, name: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """Through a slow, stalled or cut path every key completes once or is dead-lettered with
    its reason, and the worker on the faulty path stops cleanly afterwards."""
    report = await run_scenario(
        f"{service} path: {name}",
        BROKERS[broker](),
        SCENARIOS[(service, name)](),
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        faults=NETWORK_FAULTS,
    )
    assert not report.problems, report.problems
