"""`make demo`, the main job end to end (scripts/demo.py): two workers, a burst with
duplicates, conflicts, invalid and poison messages, a SIGKILL mid-run, and a summary whose
side effects equal the unique valid messages at both stages: the charges (the provider called
through a durable step) and the receipts (through the outbox). On both brokers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run_demo(broker: str, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """scripts/demo.py in a process group of its own, so that a timeout kills its workers too
    (subprocess.run's timeout kills the demo alone, and would leave them consuming)."""
    args = [sys.executable, "scripts/demo.py", "--broker", broker, "--timeout-s", "120"]
    with subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as demo:
        try:
            stdout, stderr = demo.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            stdout, stderr = demo.communicate()
            pytest.fail(f"the demo ran past {timeout_s} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    return subprocess.CompletedProcess(args, demo.returncode, stdout, stderr)


@pytest.mark.parametrize("broker", ["rabbitmq", "kafka"])
def test_the_demo_charges_every_valid_payment_and_sends_its_receipt_once_through_a_crash(
    broker: str,
) -> None:
    """Charges, provider calls and receipts once per payment across the SIGKILL."""
    result = run_demo(broker, timeout_s=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "RESULT: every valid payment charged exactly once, its receipt sent once" in result.stdout
    )
    # The summary's rows by label: "  <label padded to 30> <value>".
    lines = {re.split(r"\s{2,}", line.strip())[0]: line for line in result.stdout.splitlines()}
    assert (
        "680  (680 distinct payments)  == unique valid messages"
        in lines["side effects (charges rows)"]
    )
    assert "over 680 distinct idempotency keys: once per payment" in lines["provider calls"]
    assert "did not call again on the re-run" in lines["the runs the SIGKILL cut"]
    assert "680  (680 distinct payments)  == unique valid messages" in lines["receipts (stage 2)"]
    assert "680 rows stored with the charges, all relayed" in lines["through the outbox"]
    assert "dead-lettered                  invalid_payload 5, key_conflict 10," in result.stdout
    assert "SIGKILLed at" in result.stdout
