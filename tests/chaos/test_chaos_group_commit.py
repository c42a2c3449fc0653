"""Chaos under group commit (group_commit=True), on RabbitMQ and Kafka: workers killed at each
failpoint and frozen past the lease while the runs of a group share a transaction; nothing
lost, nothing done twice (the invariants of tests/chaos/harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import faults
from tests.chaos.conftest import run_scenario
from tests.chaos.test_chaos_workers import BROKERS

GROUP_FAULTS = {
    "kill -9 after the handler, before completion": faults.kill_at_failpoint("handled"),
    "kill -9 after completion, before the ack or offset commit": faults.kill_at_failpoint(
        "completed"
    ),
    "SIGSTOP past the lease, then SIGCONT": faults.freeze_past_the_lease,
}


@pytest.mark.parametrize("broker", list(BROKERS))
@pytest.mark.parametrize("name", list(GROUP_FAULTS))
async def test_group_commit_under_worker_faults_loses_nothing_and_does_nothing_twice(
    broker: str, name: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """A group's transaction dies with its worker or is fenced off as a whole; its runs come
    back and complete once."""
    report = await run_scenario(
        f"group commit: {name}",
        BROKERS[broker](),
        GROUP_FAULTS[name],
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        worker_env={"CHAOS_GROUP_COMMIT": "1"},
    )
    assert not report.problems, report.problems
