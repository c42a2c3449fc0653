"""Chaos in one-transaction mode (one_transaction=True), on RabbitMQ and Kafka: workers killed
inside a first delivery's open transaction (after the handler, before its completion) and
after its commit (before the ack or offset commit), and frozen past the lease while they hold
uncommitted claims; nothing lost, nothing done twice (the invariants of
tests/chaos/harness.py), and the faults did meet one-transaction runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.chaos import faults
from tests.chaos.conftest import run_scenario
from tests.chaos.test_chaos_workers import BROKERS

ONE_TRANSACTION_FAULTS = {
    "kill -9 after the handler, before completion": faults.kill_at_failpoint("handled"),
    "kill -9 after completion, before the ack or offset commit": faults.kill_at_failpoint(
        "completed"
    ),
    "SIGSTOP past the lease, then SIGCONT": faults.freeze_past_the_lease,
}

_RUNS = re.compile(r'"one_transaction": (\d+)')


def one_transaction_runs(logs: Path) -> int:
    """The one-transaction runs the workers reported (the last progress line of each)."""
    total = 0
    for log in logs.glob("worker-*.log"):
        counts = _RUNS.findall(log.read_text(errors="replace"))
        total += int(counts[-1]) if counts else 0
    return total


@pytest.mark.parametrize("broker", list(BROKERS))
@pytest.mark.parametrize("name", list(ONE_TRANSACTION_FAULTS))
async def test_one_transaction_under_worker_faults_loses_nothing_and_does_nothing_twice(
    broker: str, name: str, db_url: str, channel: str, tmp_path: Path
) -> None:
    """A transaction that dies with its worker commits nothing (the redelivery takes the
    two-commit path); one that committed makes the redelivery a duplicate; a frozen worker's
    session is ended by idle_in_transaction_session_timeout and its commit fails."""
    report = await run_scenario(
        f"one transaction: {name}",
        BROKERS[broker](),
        ONE_TRANSACTION_FAULTS[name],
        db_url=db_url,
        channel=channel,
        logs=tmp_path,
        worker_env={"CHAOS_ONE_TRANSACTION": "1"},
    )
    assert not report.problems, report.problems
    assert one_transaction_runs(tmp_path) > 0, "no run took the one-transaction path"
