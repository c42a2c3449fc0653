"""Chaos with every retry parked (DEDUPE_PARK_AFTER_S=0: each retry gives its key back and goes
through the broker, a RabbitMQ delay queue or Kafka's hold), on RabbitMQ and Kafka: workers
killed at random while poison messages wait parked between attempts; nothing lost, nothing done
twice (the invariants of tests/chaos/harness.py), each poison message dead-lettered after
max_attempts, and retries were parked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import faults
from tests.chaos.conftest import run_scenario
from tests.chaos.test_chaos_workers import BROKERS


def parked_retries(logs: Path) -> int:
    """The retries the workers parked (one warning line each)."""
    return sum(
        log.read_text(errors="replace").count("through the broker")
        for log in logs.glob("worker-*.log")
    )


@pytest.mark.parametrize("broker", list(BROKERS))
async def test_parked_retries_under_kill_9_lose_nothing_and_do_nothing_twice(
    broker: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    report = await run_scenario(
        "parked retries: kill -9 at random moments",
        BROKERS[broker](),
        faults.kill_at_random,
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        worker_env={"DEDUPE_PARK_AFTER_S": "0"},
    )
    assert not report.problems, report.problems
    assert parked_retries(tmp_path) > 0, "no retry was parked"
