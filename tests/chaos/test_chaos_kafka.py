"""Chaos on Kafka: kill, freeze, rebalance and restart; nothing lost, nothing done twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import faults
from tests.chaos.brokers import ChaosKafka
from tests.chaos.conftest import run_scenario
from tests.chaos.test_chaos_rabbitmq import SCENARIOS, restarts_allowed
from tests.conftest import KAFKA_URL

RESTARTS = {
    "Kafka broker restart": faults.restart_kafka,
    "PostgreSQL restart": faults.restart_postgres,
}


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_kafka_worker_faults_lose_nothing_and_do_nothing_twice(
    name: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """Under each worker fault every key completes once or is dead-lettered with its reason."""
    report = await run_scenario(
        name,
        ChaosKafka(KAFKA_URL),
        SCENARIOS[name],
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
@pytest.mark.parametrize("name", list(RESTARTS))
async def test_kafka_service_restarts_lose_nothing_and_do_nothing_twice(
    name: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """The broker or the database restarts twice under the workers: they recover by themselves."""
    report = await run_scenario(
        name,
        ChaosKafka(KAFKA_URL),
        RESTARTS[name],
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        faults=2,
    )
    assert not report.problems, report.problems
