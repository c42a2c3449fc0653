"""The two-stage chain under faults (tests/apps/chain.py): stage A publishes each order through
the outbox to stage B on another channel, and the workers' relays carry it there.

Stage A is held to the invariants of tests/chaos/harness.py, as the chaos app is. Beyond them:

- the outbox holds exactly one row per key that must run, each with its own message id: a
  failed attempt's or a zombie's publishes rolled back with its writes;
- stage B has exactly one effect (`chain_effects`) per such key, none for any other key, and
  each carries the message id of its key's outbox row; B's dead-letter queue stays empty;
- drained: within lease + 30 s of the last fault, every outbox row is sent, stage B has
  completed every key, and both channels are empty.

Calls to the external service go through a durable step in stage A: a re-run after a kill
returns the recorded result. They repeat only for a run killed between the call's return and
its record's commit (a kill takes every run of the process with it, wherever it is); the
report counts those repeats.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from tests.apps import chain
from tests.apps.chaos import SCHEMA
from tests.chaos.brokers import ChaosKafka, ChaosRabbit
from tests.chaos.conftest import FAULTS, LEASE_S, SIZE, record
from tests.chaos.faults import Fault, Run
from tests.chaos.harness import Probe, Workers, check
from tests.chaos.workload import Workload


@dataclass
class ChainReport:
    """One chain scenario's row in RELIABILITY.md."""

    scenario: str
    messages: int
    faults: int
    lost_a: int
    doubled_a: int
    outbox_rows: int
    lost_b: int
    doubled_b: int
    external_repeats: int
    drain_s: float
    total_s: float
    problems: list[str]

    def row(self) -> str:
        verdict = "pass" if not self.problems else "FAIL"
        return (
            f"| {self.scenario} | {self.messages} | {self.faults} | {self.lost_a} | "
            f"{self.doubled_a} | {self.outbox_rows} | {self.lost_b} | {self.doubled_b} | "
            f"{self.external_repeats} | {self.drain_s:.1f} | {self.total_s:.1f} | {verdict} |"
        )


async def wait_chain_drained(
    probe: Probe,
    backlog: Callable[[], Awaitable[int]],
    workload: Workload,
    *,
    within_s: float,
) -> float:
    """Wait until stage A settled every key that gets a claim, the outbox is sent, stage B
    completed every key that must run, nothing is in progress and both channels are empty."""
    began = time.monotonic()
    state: dict[str, Any] = {}
    while time.monotonic() - began < within_s:
        [row] = await probe.fetch(
            "SELECT (SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL) AS unsent,"
            " (SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress') AS in_progress,"
            " (SELECT count(*) FROM dedupe_claims"
            "   WHERE scope = $1 AND status = 'completed') AS delivered",
            chain.NEXT_SCOPE,
        )
        state = {
            "settled": await probe.settled(),
            "expected": workload.claimed,
            **dict(row),
            "must_deliver": len(workload.normal),
            "backlog": await backlog(),
        }
        if (
            state["settled"] >= workload.claimed
            and state["delivered"] >= len(workload.normal)
            and state["unsent"] == state["in_progress"] == state["backlog"] == 0
        ):
            return time.monotonic() - began
        await asyncio.sleep(0.25)
    # What holds the unsent rows back: a refusal's backoff (attempts, due in how long) or not.
    unsent = await probe.fetch(
        "SELECT channel, attempts, last_error,"
        " round(extract(epoch FROM next_try_at - now())::numeric, 1) AS due_in_s"
        " FROM dedupe_outbox WHERE sent_at IS NULL ORDER BY id LIMIT 5"
    )
    raise AssertionError(
        f"the chain did not drain within {within_s:.0f}s of the last fault: {state}; "
        f"unsent rows: {[dict(r) for r in unsent]}"
    )


async def check_chain(
    probe: Probe, next_letters: list[dict[str, Any]], workload: Workload
) -> tuple[list[str], dict[str, int]]:
    """Stage B and the outbox (stage A is checked by harness.check). Returns (problems, figures)."""
    problems: list[str] = []
    rows = await probe.fetch(
        "SELECT o.message_id, o.body, o.sent_at IS NOT NULL AS sent FROM dedupe_outbox o"
    )
    outbox_ids = {r["message_id"] for r in rows}
    if len(outbox_ids) != len(rows):
        problems.append(f"outbox: {len(rows) - len(outbox_ids)} message ids stored twice")
    if len(rows) != len(workload.normal):
        problems.append(f"outbox: {len(rows)} rows for {len(workload.normal)} keys that must run")
    if unsent := sum(1 for r in rows if not r["sent"]):
        problems.append(f"outbox: {unsent} rows never sent")
    effects = await probe.fetch(
        "SELECT business_key, count(*) AS n, array_agg(DISTINCT message_id) AS ids"
        " FROM chain_effects GROUP BY business_key"
    )
    delivered = {r["business_key"]: r["n"] for r in effects}
    doubled = {key: n for key, n in delivered.items() if n > 1}
    if doubled:
        problems.append(f"stage B ran twice: {sorted(doubled)[:10]}")
    missing = workload.normal - delivered.keys()
    if missing:
        problems.append(f"stage B lost {len(missing)} keys, e.g. {sorted(missing)[:10]}")
    if unexpected := delivered.keys() - workload.normal:
        problems.append(f"stage B ran for keys that must not run: {sorted(unexpected)[:10]}")
    foreign = {r["business_key"] for r in effects if not set(r["ids"]) <= outbox_ids}
    if foreign:
        problems.append(f"stage B ran messages the outbox never held: {sorted(foreign)[:10]}")
    if next_letters:
        problems.append(f"stage B dead-lettered {len(next_letters)}: {next_letters[:3]}")
    calls = await probe.value(
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM chaos_external"
        " GROUP BY business_key) AS per_key"
    )
    figures = {
        "outbox_rows": len(rows),
        "lost_b": len(missing),
        "doubled_b": sum(n - 1 for n in doubled.values()),
        "external_repeats": int(calls),
    }
    return problems, figures


async def run_chain_scenario(
    name: str,
    broker: ChaosRabbit | ChaosKafka,
    fault: Fault,
    *,
    db_url: str,
    channel: str,
    next_channel: str,
    logs: Path,
    faults: int = FAULTS,
    size: int = SIZE,
) -> ChainReport:
    """Publish the workload to stage A, run two workers under `fault`, drain, check."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(SCHEMA + chain.SCHEMA)
    finally:
        await conn.close()
    workload = Workload(size)
    probe = Probe(db_url, scope=chain.SCOPE)
    env = {
        "DEDUPE_DATABASE_URL": db_url,
        "DEDUPE_BROKER_URL": broker.worker_url(channel),
        "DEDUPE_STATS_INTERVAL_S": "2",
        "DEDUPE_GC_INTERVAL_S": "0",
        "CHAOS_CHANNEL": channel,
        "CHAIN_NEXT": next_channel,
        "CHAOS_LEASE_S": str(LEASE_S),
    }
    workers = Workers(env, logs, app="tests.apps.chain:app")
    run = Run(
        workers=workers,
        probe=probe,
        workload=workload,
        faults=faults,
        lease_s=LEASE_S,
        timeout_s=max(300.0, size / 10),
    )

    async def backlog() -> int:
        return await broker.backlog(channel) + await broker.backlog(next_channel)

    began = time.monotonic()
    try:
        await broker.publish(channel, workload.messages)
        injected = await fault(run)
        run.keep_workers()
        drain_s = await wait_chain_drained(probe, backlog, workload, within_s=LEASE_S + 30)
        total_s = time.monotonic() - began
        run.keep_workers()
    finally:
        workers.stop()
    letters = await broker.dead_letters(channel, limit=workload.letters_at_most)
    problems, figures = await check(probe, letters, workload)
    chained, more = await check_chain(probe, await broker.dead_letters(next_channel), workload)
    problems += chained
    if run.unexpected_exits:
        problems.append(f"{run.unexpected_exits} worker(s) exited without being killed")
    if injected < 1:
        problems.append("no fault was injected")
    report = ChainReport(
        scenario=f"{broker.name}: {name}",
        messages=len(workload.messages),
        faults=injected,
        lost_a=figures["lost"],
        doubled_a=figures["duplicated_effects"],
        outbox_rows=more["outbox_rows"],
        lost_b=more["lost_b"],
        doubled_b=more["doubled_b"],
        external_repeats=more["external_repeats"],
        drain_s=drain_s,
        total_s=total_s,
        problems=problems,
    )
    await record(report)
    return report
