"""What scripts/services.sh starts is fit for a long-lived developer or CI machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def _limit(pid: str, name: str) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith(name):
            return int(line[len(name) :].split()[0])
    raise AssertionError(f"no {name!r} in /proc/{pid}/limits")


def test_the_rabbitmq_node_may_open_more_files_than_the_pam_default() -> None:
    """Started through `su`, the node would get 1024 open files (pam_limits) and stall at boot
    while recovering more durable queues than that; services.sh raises the limit."""
    # The nodes (`-s rabbit boot`), not the Erlang VMs of rabbitmqctl calls that other tests
    # run meanwhile (as the rabbitmq user too, with pam's 1024 files, and short-lived).
    found = subprocess.run(
        ["pgrep", "-u", "rabbitmq", "-f", "beam.smp.*-s rabbit boot"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    pids = found.stdout.split()
    assert pids, "no RabbitMQ node running; run `make services`"
    assert all(_limit(pid, "Max open files") > 4096 for pid in pids)


def test_status_reports_every_service_up() -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "services.sh"
    status = subprocess.run(
        ["bash", str(script), "status"], capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0, status.stdout + status.stderr
    for service in ("postgres", "rabbitmq", "kafka"):
        assert re.search(rf"{service}\s+up\b", status.stdout), status.stdout
