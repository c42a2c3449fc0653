"""Chaos on RabbitMQ: kill, freeze and restart everything; nothing lost, nothing done twice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos import faults
from tests.chaos.brokers import ChaosRabbit
from tests.chaos.conftest import run_scenario

SCENARIOS = {
    "kill -9 after the claim": faults.kill_at_failpoint("claimed"),
    "kill -9 after the handler, before completion": faults.kill_at_failpoint("handled"),
    "kill -9 after completion, before the ack": faults.kill_at_failpoint("completed"),
    "kill -9 at random moments": faults.kill_at_random,
    "SIGSTOP past the lease, then SIGCONT": faults.freeze_past_the_lease,
    "pg_terminate_backend during commits": faults.terminate_backends,
}

RESTARTS = {
    "RabbitMQ restart": faults.restart_rabbitmq,
    "PostgreSQL restart": faults.restart_postgres,
}


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_rabbitmq_worker_faults_lose_nothing_and_do_nothing_twice(
    name: str, db_url: str, amqp_url: str, channel: str, tmp_path: Path
) -> None:
    """Under each worker fault every key completes once or is dead-lettered with its reason."""
    report = await run_scenario(
        name,
        ChaosRabbit(amqp_url),
        SCENARIOS[name],
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
    )
    assert not report.problems, report.problems


# Restarting the shared services would break whatever else is running against them, so these
# run only where asked for: `make test` (and so CI) sets DEDUPE_CHAOS_RESTARTS=1.
restarts_allowed = pytest.mark.skipif(
    os.environ.get("DEDUPE_CHAOS_RESTARTS") != "1",
    reason="restarts the shared services; set DEDUPE_CHAOS_RESTARTS=1 (make test does)",
)


@restarts_allowed
@pytest.mark.parametrize("name", list(RESTARTS))
async def test_rabbitmq_service_restarts_lose_nothing_and_do_nothing_twice(
    name: str, db_url: str, amqp_url: str, channel: str, tmp_path: Path
) -> None:
    """The broker or the database restarts twice under the workers: they recover by themselves."""
    report = await run_scenario(
        name,
        ChaosRabbit(amqp_url),
        RESTARTS[name],
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        faults=2,
    )
    assert not report.problems, report.problems
