"""The chaos harness: a recorded workload, real worker processes, faults, and the invariants.

History: every confirmed publish (the workload, published with confirms), every database side
effect (`chaos_effects`, written through ctx.db), every call to the stand-in external service
with the idempotency key it was given (`chaos_external`), every dead letter (the broker's DLQ).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from tests.apps.chaos import SCOPE, STORED_RESULTS
from tests.chaos.workload import Workload

ROOT = Path(__file__).resolve().parents[2]


class Workers:
    """Real `dedupe-worker run tests.apps.chaos:app` processes (or another app's)."""

    def __init__(
        self,
        env: dict[str, str],
        logs: Path,
        *,
        concurrency: int = 16,
        app: str = "tests.apps.chaos:app",
    ) -> None:
        self.env = env
        self.logs = logs
        self.concurrency = concurrency
        self.app = app
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = 0
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, **extra_env: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"worker-{self.started}.log", "wb")  # noqa: SIM115
        self.started += 1
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dedupe.cli",
                "run",
                self.app,
                "--concurrency",
                str(self.concurrency),
                "--shutdown-timeout-s",
                "5",
            ],
            cwd=ROOT,
            env={**os.environ, **self.env, **extra_env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    @property
    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [proc for proc in self.procs if proc.poll() is None]

    def reap(self) -> list[subprocess.Popen[bytes]]:
        """Forget the processes that died; return them."""
        dead = [proc for proc in self.procs if proc.poll() is not None]
        self.procs = [proc for proc in self.procs if proc.poll() is None]
        return dead

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


class Probe:
    """Reads the database with a fresh, retried connection: it must survive PostgreSQL restarts.

    `scope` is the workload handler's scope (its tenants' claims are under `<scope>/`).
    """

    def __init__(self, url: str, *, scope: str = SCOPE) -> None:
        self.url = url
        self.scope = scope

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        last: Exception | None = None
        for _ in range(60):
            try:
                conn = await asyncpg.connect(self.url, timeout=5)
                try:
                    return list(await conn.fetch(query, *args))
                finally:
                    await conn.close()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                last = exc
                await asyncio.sleep(0.5)
        raise AssertionError(f"the database stayed unreachable: {last}")

    async def value(self, query: str, *args: Any) -> Any:
        rows = await self.fetch(query, *args)
        return rows[0][0] if rows else None

    async def settled(self) -> int:
        """The workers' keys with a final outcome (completed or failed); not the receiver's."""
        return int(
            await self.value(
                "SELECT count(*) FROM dedupe_claims"
                " WHERE status <> 'in_progress' AND starts_with(scope, $1)",
                f"{self.scope}/",
            )
        )


@dataclass
class Report:
    """One scenario's row in RELIABILITY.md."""

    scenario: str
    messages: int
    duplicates: int
    faults: int
    lost: int
    duplicated_effects: int
    external_keys_differing: int
    drain_s: float
    total_s: float
    problems: list[str]
    # A configuration that does not promise the invariants (an asynchronous standby's
    # failover): its row says what was measured, not pass or fail.
    measured: bool = False

    def row(self) -> str:
        verdict = "pass" if not self.problems else "FAIL"
        if self.measured:
            verdict = "measured" + (
                f": {len(self.problems)} invariants broken" * bool(self.problems)
            )
        return (
            f"| {self.scenario} | {self.messages} | {self.duplicates} | {self.faults} | "
            f"{self.lost} | {self.duplicated_effects} | {self.external_keys_differing} | "
            f"{self.drain_s:.1f} | {self.total_s:.1f} | {verdict} |"
        )


async def wait_drained(
    probe: Probe,
    backlog: Callable[[], Awaitable[int]],
    expected: int,
    *,
    within_s: float,
) -> float:
    """Wait until `expected` keys have their outcome, nothing is in progress and the queues
    are empty."""
    began = time.monotonic()
    state: dict[str, Any] = {}
    while time.monotonic() - began < within_s:
        settled = await probe.settled()
        in_progress = await probe.value(
            "SELECT count(*) FROM dedupe_claims WHERE status = 'in_progress'"
        )
        pending = await backlog()
        state = {
            "settled": settled,
            "expected": expected,
            "in_progress": in_progress,
            "backlog": pending,
        }
        if settled >= expected and in_progress == 0 and pending == 0:
            return time.monotonic() - began
        await asyncio.sleep(0.25)
    stuck = await probe.fetch(
        "SELECT key, token, attempts, owner, error, lease_until, updated_at FROM dedupe_claims"
        " WHERE status = 'in_progress' LIMIT 5"
    )
    raise AssertionError(
        f"not drained within {within_s:.0f}s of the last fault: {state}; "
        f"stuck: {[dict(r) for r in stuck]}"
    )


def business_key(claim_key: str) -> str:
    """The workload's key inside a claim key (the receiver forwards "<source>/<tenant>/<key>")."""
    return claim_key.rsplit("/", 1)[-1]


async def check(
    probe: Probe,
    dead_letters: list[dict[str, Any]],
    workload: Workload,
    *,
    conflicts_dead_lettered: bool = True,
) -> tuple[list[str], dict[str, int]]:
    """The invariants. Returns (problems, figures).

    `conflicts_dead_lettered`: behind the receiver a conflicting body is refused with 422 and
    never published, so it must *not* reach the dead-letter queue.
    """
    problems: list[str] = []
    effects = {
        r["business_key"]: r["n"]
        for r in await probe.fetch(
            "SELECT business_key, count(*) AS n FROM chaos_effects GROUP BY business_key"
        )
    }
    doubled = {key: n for key, n in effects.items() if n > 1}
    if doubled:
        problems.append(f"database side effects ran twice: {sorted(doubled)[:10]}")
    missing = workload.normal - effects.keys()
    if missing:
        problems.append(f"lost: no effect for {len(missing)} keys, e.g. {sorted(missing)[:10]}")
    unexpected = effects.keys() - workload.normal
    if unexpected:
        problems.append(f"effects for keys that must not run: {sorted(unexpected)[:10]}")

    external = {
        r["business_key"]: (r["keys"], r["calls"])
        for r in await probe.fetch(
            "SELECT business_key, count(DISTINCT idempotency_key) AS keys, count(*) AS calls"
            " FROM chaos_external GROUP BY business_key"
        )
    }
    differing = {key for key, (keys, _) in external.items() if keys != 1}
    if differing:
        problems.append(f"external calls with differing idempotency keys: {sorted(differing)[:10]}")
    if workload.normal - external.keys():
        problems.append("some keys never called the external service")
    if ran := external.keys() - workload.normal:
        problems.append(f"external calls for keys that must not run: {sorted(ran)[:10]}")

    statuses = dict(await probe.fetch("SELECT status, count(*) FROM dedupe_claims GROUP BY 1"))
    if statuses.get("in_progress"):
        problems.append(f"{statuses['in_progress']} claims still in progress")

    # Every conflict and poison message is in the dead-letter queue with its reason, and
    # nothing else is. At least once: a worker killed after publishing a dead letter but
    # before acknowledging the message publishes it again on the next delivery.
    letters = {
        (business_key(str(d.get("key") or d.get("message_id"))), str(d["reason"]))
        for d in dead_letters
    }
    expected = {(key, "max_attempts_exceeded") for key in workload.poison}
    if conflicts_dead_lettered:
        expected |= {(key, "key_conflict") for key in workload.conflicts}
    # A hostile key or tenant is refused before any claim, so every copy is dead-lettered;
    # its dead letter names no key (it could not carry one), only the message id.
    unclaimable = workload.invalid_keys.keys() | workload.invalid_tenants
    expected |= {(key, "invalid_key") for key in unclaimable}
    if letters != expected:
        problems.append(
            f"dead letters differ: unexpected {sorted(letters - expected)[:10]}, "
            f"missing {sorted(expected - letters)[:10]}"
        )
    problems += await check_claims(probe, workload)
    figures = {
        "lost": len(missing),
        "duplicated_effects": sum(n - 1 for n in doubled.values()),
        "external_keys_differing": len(differing),
        "external_calls": sum(calls for _, calls in external.values()),
    }
    return problems, figures


async def check_claims(probe: Probe, workload: Workload) -> list[str]:
    """The workers' claims: one per key but the hostile keys and tenants (none for those), and
    each hostile result completed and stored mended (U+FFFD for NUL and lone surrogates, null
    for NaN)."""
    problems: list[str] = []
    claimed = {
        r["key"]
        for r in await probe.fetch(
            "SELECT key FROM dedupe_claims WHERE starts_with(scope, $1)", f"{probe.scope}/"
        )
    }
    # The hostile keys themselves cannot be stored (NUL, a surrogate) or are not expected
    # (600 characters); a hostile tenant's row would hold its message id as the key.
    unexpected = claimed - workload.normal - workload.poison
    if unexpected:
        problems.append(
            f"claims for keys that must have none: {sorted(k[:40] for k in unexpected)[:10]}"
        )
    rows = await probe.fetch(
        "SELECT key, status, result::text AS result FROM dedupe_claims"
        " WHERE starts_with(scope, $1) AND key = ANY($2::text[])",
        f"{probe.scope}/",
        sorted(workload.hostile_results),
    )
    stored = {r["key"]: (r["status"], r["result"]) for r in rows}
    for key, kind in sorted(workload.hostile_results.items()):
        want = {"v": int(key.rsplit("-", 1)[1]), "note": STORED_RESULTS[kind]}
        status, result = stored.get(key, (None, None))
        if status != "completed" or result is None or json.loads(result) != want:
            problems.append(f"hostile result {key}: {status}, stored {result!r}, want {want}")
    return problems
