"""Chaos under the workers, on RabbitMQ and on Kafka: kill, freeze, rebalance and restart
everything; nothing lost, nothing done twice (invariants in tests/chaos/harness.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos import faults
from tests.chaos.brokers import ChaosKafka, ChaosRabbit
from tests.chaos.conftest import run_scenario
from tests.conftest import AMQP_URL, KAFKA_URL

# Restarts per restart scenario (each takes seconds of a service's start-up): 2 in make test,
# CHAOS_RESTART_FAULTS (make chaos: 10) in the large run.
RESTART_FAULTS = int(os.environ.get("CHAOS_RESTART_FAULTS", "2"))

BROKERS = {"rabbitmq": lambda: ChaosRabbit(AMQP_URL), "kafka": lambda: ChaosKafka(KAFKA_URL)}

WORKER_FAULTS = {
    "kill -9 after the claim": faults.kill_at_failpoint("claimed"),
    "kill -9 after the handler, before completion": faults.kill_at_failpoint("handled"),
    "kill -9 after completion, before the ack or offset commit": faults.kill_at_failpoint(
        "completed"
    ),
    "kill -9 at random moments": faults.kill_at_random,
    "SIGSTOP past the lease, then SIGCONT": faults.freeze_past_the_lease,
    "pg_terminate_backend during commits": faults.terminate_backends,
}

RESTARTS = {
    ("rabbitmq", "RabbitMQ restart"): faults.restart_rabbitmq,
    ("rabbitmq", "PostgreSQL restart"): faults.restart_postgres,
    ("kafka", "Kafka broker restart"): faults.restart_kafka,
    ("kafka", "PostgreSQL restart"): faults.restart_postgres,
}

# Restarting the shared services breaks whatever else runs against them (a developer's own
# workers, a second test run): DEDUPE_CHAOS_RESTARTS=0 skips these scenarios.
restarts_allowed = pytest.mark.skipif(
    os.environ.get("DEDUPE_CHAOS_RESTARTS", "1") == "0",
    reason="DEDUPE_CHAOS_RESTARTS=0: the scenarios that restart the shared services are off",
)


@pytest.mark.parametrize("broker", list(BROKERS))
@pytest.mark.parametrize("name", list(WORKER_FAULTS))
async def test_worker_faults_lose_nothing_and_do_nothing_twice(
    broker: str, name: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """Under each worker fault every key completes once or is dead-lettered with its reason."""
    report = await run_scenario(
        name,
        BROKERS[broker](),
        WORKER_FAULTS[name],
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
    )
    assert not report.problems, report.problems


async def test_kafka_consumers_scaled_1_3_2_lose_nothing_and_do_nothing_twice(
    db_url: str, channel: str, tmp_path: Path
) -> None:
    """A consumer group grows from one worker to three, then shrinks to two, mid-stream."""
    report = await run_scenario(
        "consumers scaled 1 -> 3 -> 2",
        ChaosKafka(KAFKA_URL),
        faults.scale_consumers,
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        faults=2,
    )
    assert not report.problems, report.problems


@restarts_allowed
@pytest.mark.parametrize(("broker", "name"), list(RESTARTS))
async def test_service_restarts_lose_nothing_and_do_nothing_twice(
    broker: str, name: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """The broker or the database restarts under the workers: they recover by themselves."""
    report = await run_scenario(
        name,
        BROKERS[broker](),
        RESTARTS[(broker, name)],
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        faults=RESTART_FAULTS,
    )
    assert not report.problems, report.problems
