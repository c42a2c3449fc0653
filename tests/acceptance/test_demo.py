"""`make demo`, the main job end to end (scripts/demo.py): two workers, a burst with
duplicates, conflicts, invalid and poison messages, a SIGKILL mid-run, and a summary whose
side effects equal the unique valid messages. On both brokers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("broker", ["rabbitmq", "kafka"])
def test_the_demo_charges_every_valid_payment_exactly_once_through_a_crash(broker: str) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/demo.py", "--broker", broker, "--timeout-s", "120"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RESULT: every valid payment charged exactly once" in result.stdout
    assert "680  (680 distinct payments)  == unique valid messages" in result.stdout
    assert "dead-lettered                  invalid_payload 5, key_conflict 10," in result.stdout
    assert "SIGKILLed at" in result.stdout
