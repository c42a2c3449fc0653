"""Chaos scenarios: real worker processes, real services, faults, invariants.

Sizes: CHAOS_N logical messages (default 2,000) and CHAOS_FAULTS faults per scenario (default
5) — `make test` runs this small size; `make chaos` runs N = 100,000 with 50 faults. Each
scenario's row is appended to the file named by CHAOS_REPORT, if set (RELIABILITY.md's table).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Protocol

import asyncpg

from tests.apps.chaos import SCHEMA
from tests.chaos.faults import Fault, Run
from tests.chaos.harness import Probe, Report, Workers, check, wait_drained
from tests.chaos.workload import Workload
from tests.integration.brokers import Broker

LEASE_S = 2.0
SIZE = int(os.environ.get("CHAOS_N", "2000"))
FAULTS = int(os.environ.get("CHAOS_FAULTS", "5"))


def _append(path: Path, line: str) -> None:
    with path.open("a") as table:
        table.write(line)


async def run_scenario(
    name: str,
    broker: Broker,
    fault: Fault,
    *,
    db_url: str,
    channel: str,
    logs: Path,
    faults: int = FAULTS,
    size: int = SIZE,
    worker_env: dict[str, str] | None = None,
    promised: bool = True,
) -> Report:
    """Publish the workload, run two workers under `fault`, drain, check the invariants.

    `promised=False`: the configuration does not promise them (an asynchronous standby's
    failover): a run that does not drain is measured and reported, not cut short.
    """
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()
    workload = Workload(size)
    probe = Probe(db_url)
    env = {
        "DEDUPE_DATABASE_URL": db_url,
        "DEDUPE_BROKER_URL": broker.worker_url(channel),
        "DEDUPE_STATS_INTERVAL_S": "2",
        "DEDUPE_GC_INTERVAL_S": "0",
        "CHAOS_CHANNEL": channel,
        "CHAOS_LEASE_S": str(LEASE_S),
        **(worker_env or {}),
    }
    workers = Workers(env, logs)
    run = Run(
        workers=workers,
        probe=probe,
        workload=workload,
        faults=faults,
        lease_s=LEASE_S,
        timeout_s=max(300.0, size / 20),
    )
    began = time.monotonic()
    try:
        await broker.publish(channel, workload.messages)
        injected = await fault(run)
        run.keep_workers()
        try:
            # What a configuration does not promise is measured after a shorter wait.
            drain_s = await wait_drained(
                probe,
                lambda: broker.backlog(channel),
                workload.claimed,
                within_s=LEASE_S + (30 if promised else 15),
            )
        except AssertionError as exc:
            if promised:
                raise
            drain_s, not_drained = float("nan"), str(exc)
        else:
            not_drained = ""
        total_s = time.monotonic() - began
        run.keep_workers()
    finally:
        workers.stop()
    letters = await broker.dead_letters(channel, limit=workload.letters_at_most)
    problems, figures = await check(probe, letters, workload)
    if not_drained:
        problems.append(not_drained[:2000])
    if run.unexpected_exits:
        problems.append(f"{run.unexpected_exits} worker(s) exited without being killed")
    if injected < 1:
        problems.append("no fault was injected")
    report = Report(
        scenario=f"{broker.name}: {name}",
        messages=len(workload.messages),
        duplicates=workload.duplicates,
        faults=injected,
        lost=figures["lost"],
        duplicated_effects=figures["duplicated_effects"],
        external_keys_differing=figures["external_keys_differing"],
        drain_s=drain_s,
        total_s=total_s,
        problems=problems,
        measured=not promised,
    )
    await record(report)
    return report


class Row(Protocol):
    """A scenario's result that renders as its table row."""

    def row(self) -> str: ...


async def record(report: Row) -> None:
    """Print the scenario's table row and append it to CHAOS_REPORT, if set."""
    out = os.environ.get("CHAOS_REPORT")
    if out:
        await asyncio.to_thread(_append, Path(out), report.row() + "\n")
    print(report.row())
