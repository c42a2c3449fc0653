"""dedupe.testing's crash points and take-overs: a worker dies after the claim, after the handler,
after the commit; it leaves its claim as a dead process does; another worker takes over without
waiting for the lease; a stalled worker comes back as a zombie and is fenced."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.testing import Stage, TestRun
from tests.conftest import ADMIN_URL

SCHEMA = "CREATE TABLE effects (key text NOT NULL, worker text NOT NULL)"


class Job(BaseModel):
    n: int


def effect_app(calls: list[str]) -> App:
    app = App("crash")

    @app.handler("jobs", lease_s=30)
    async def work(job: Job, ctx: Context) -> int:
        from dedupe.testing import current_run

        run = current_run()
        assert run is not None
        calls.append(run.worker.name)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, run.worker.name)
        return job.n

    return app


async def events(run: TestRun) -> list[tuple[str, str | None]]:
    rows = await run.fetch("SELECT event, detail FROM dedupe_claim_events ORDER BY id")
    return [(row["event"], row["detail"]) for row in rows]


@pytest.mark.parametrize("stage", ["claimed", "handled"])
async def test_a_worker_that_dies_before_the_commit_leaves_its_claim_as_a_dead_process_does(
    stage: Stage,
) -> None:
    """No give-back, no completion, no ack, no ctx.db write: in progress, its lease still live."""
    calls: list[str] = []
    async with TestRun(effect_app(calls), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.crash_at(stage, expire_lease=False)
        sent = run.publish("jobs", {"n": 1}, message_id="j-1")
        with pytest.raises(AssertionError, match="not idle"):
            await run.idle(timeout_s=0.5)  # b is deferred while a's lease lives
        [claim] = await run.claims()
        assert (claim.status, claim.owner, claim.attempts) == ("in_progress", "worker-a", 1)
        assert claim.lease_live and claim.error is None  # a give-back says 'handed back'
        assert await run.fetchval("SELECT count(*) FROM effects") == 0
        assert [w.state for w in run.workers] == ["dead", "running"]
        assert {s.consumer for s in sent.log} == {"b"}  # a told the broker nothing
        assert all(s.fate == "redelivered" for s in sent.log)
        assert await run.expire_leases() == 1
        await run.idle()
        assert calls == (["a", "b"] if stage == "handled" else ["b"])
        assert await run.fetch("SELECT key, worker FROM effects") == [("j-1", "b")]
        [claim] = await run.claims()
        assert (claim.status, claim.owner, claim.attempts) == ("completed", "worker-b", 2)
        assert ("taken_over", "from worker-a (in_progress)") in await events(run)
        assert run.workers[1].stats.taken_over == 1


async def test_a_worker_that_dies_after_the_commit_is_followed_by_a_duplicate() -> None:
    """Committed, never acked: the redelivery to the next worker is acked as a duplicate."""
    calls: list[str] = []
    async with TestRun(effect_app(calls), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.crash_at("completed")
        sent = run.publish("jobs", {"n": 7}, message_id="j-7")
        await run.idle()
        assert calls == ["a"]
        [claim] = await run.claims()
        assert (claim.status, claim.owner, claim.result) == ("completed", "worker-a", 7)
        [(consumer, fate, duplicate)] = [(s.consumer, s.fate, s.duplicate) for s in sent.log]
        assert (consumer, fate, duplicate) == ("b", "acked", True)


async def test_a_crash_with_the_lease_taken_over_runs_the_key_again_without_waiting() -> None:
    """The default: the dead worker's lease is made to lapse, so b takes over in well under
    lease_s (30 s) and the ctx.db write of a's run never happened."""
    calls: list[str] = []
    async with TestRun(effect_app(calls), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.crash_at("handled")
        run.publish("jobs", {"n": 1}, message_id="j-1")
        await run.idle(timeout_s=10)
        assert calls == ["a", "b"]
        assert await run.fetch("SELECT key, worker FROM effects") == [("j-1", "b")]
        assert [(r.key, r.worker) for r in run.runs] == [("j-1", "a"), ("j-1", "b")]


async def test_a_dead_workers_connections_are_gone_so_its_open_transaction_rolled_back() -> None:
    """Died after the handler wrote through ctx.db: the server saw the connection drop; no
    session of the dead worker is left, and no row of its write."""
    async with TestRun(effect_app([]), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.crash_at("handled", expire_lease=False)
        run.publish("jobs", {"n": 1}, message_id="j-1")
        with pytest.raises(AssertionError):
            await run.idle(timeout_s=0.5)
        database = run.database_url.rsplit("/", 1)[1]
        admin = await asyncpg.connect(ADMIN_URL)
        try:
            # The server ends a backend when it reads the end of its socket: soon, not at once
            # (a busy machine took longer than the half second above once).
            for _ in range(50):
                idle_in_tx = await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = $1"
                    " AND state LIKE 'idle in transaction%'",
                    database,
                )
                if idle_in_tx == 0:
                    break
                await asyncio.sleep(0.1)
        finally:
            await admin.close()
        assert idle_in_tx == 0
        assert await run.fetchval("SELECT count(*) FROM effects") == 0


async def test_only_the_message_of_the_crash_points_key_crashes() -> None:
    """crash_at(key=...) lets other keys through and kills the worker at that key's stage."""
    calls: list[str] = []
    async with TestRun(effect_app(calls), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.crash_at("handled", key="j-2")
        run.publish("jobs", {"n": 1}, message_id="j-1")
        await run.idle()
        run.publish("jobs", {"n": 2}, message_id="j-2")
        await run.idle()
        rows = await run.fetch("SELECT key, worker FROM effects ORDER BY key")
        assert [tuple(r) for r in rows] == [("j-1", "a"), ("j-2", "b")]


async def test_a_stalled_worker_taken_over_comes_back_as_a_zombie_and_is_fenced() -> None:
    """Held after its handler, its lease lapses; b completes; a resumes: its completion is
    refused by the token, its ctx.db write rolls back and its settlement is dropped."""
    calls: list[str] = []
    async with TestRun(effect_app(calls), database_url=ADMIN_URL, schema=SCHEMA) as run:
        stall = run.stall_at("handled")
        sent = run.publish("jobs", {"n": 3}, message_id="j-3")
        await stall.reached()
        assert stall.worker == "a"
        with pytest.raises(AssertionError, match="worker a is stalled"):
            await run.idle(timeout_s=0.2)
        taker = await run.take_over()
        assert taker.name == "b"
        await run.idle()
        stall.resume()
        await run.idle()
        assert calls == ["a", "b"]
        assert await run.fetch("SELECT key, worker FROM effects") == [("j-3", "b")]
        zombie = run.workers[0]
        assert (zombie.state, zombie.stats.fenced) == ("taken_over", 1)
        assert [(s.consumer, s.fate) for s in sent.log] == [("b", "acked"), ("a", "dropped")]


async def test_a_stalled_worker_stops_heartbeating_so_its_lease_runs_out() -> None:
    """While held, the worker's heartbeat sends nothing: the lease lapses by itself."""
    app = App("crash")

    @app.handler("jobs", lease_s=0.6)
    async def work(job: Job) -> None:
        return None

    async with TestRun(app, database_url=ADMIN_URL) as run:
        stall = run.stall_at("claimed")
        run.publish("jobs", {"n": 1}, message_id="j-1")
        await stall.reached()
        # Heartbeats every 0.2 s would keep the lease live for good; held, it lapses.
        seen = []
        for _ in range(100):
            [claim] = await run.claims()
            seen.append((claim.status, claim.lease_live))
            if not claim.lease_live:
                break
            await asyncio.sleep(0.05)
        assert seen[-1] == ("in_progress", False), seen
        stall.resume()
        await run.idle()


async def test_take_over_without_a_stalled_worker_says_what_to_do() -> None:
    """take_over() needs a worker held by stall_at."""
    async with TestRun(effect_app([]), database_url=ADMIN_URL, schema=SCHEMA) as run:
        with pytest.raises(RuntimeError, match="stall_at"):
            await run.take_over()


async def test_the_worker_that_took_over_waits_behind_the_zombies_row_until_it_is_fenced() -> None:
    """The zombie's open transaction holds the row b inserts too: b waits (blocked() says so)
    until the zombie wakes, is fenced and rolls back; then b completes."""
    app = App("crash")

    @app.handler("jobs", lease_s=30)
    async def work(job: Job, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO unique_effects VALUES ($1)", ctx.key)

    schema = "CREATE TABLE unique_effects (key text PRIMARY KEY)"
    async with TestRun(app, database_url=ADMIN_URL, schema=schema) as run:
        stall = run.stall_at("handled")
        run.publish("jobs", {"n": 1}, message_id="j-1")
        await stall.reached()
        await run.take_over()
        for _ in range(500):
            if await run.blocked():
                break
            await asyncio.sleep(0.01)
        assert await run.blocked() == 1 and not run.quiet
        stall.resume()
        await run.idle()
        assert await run.fetchval("SELECT count(*) FROM unique_effects") == 1
        assert [w.stats.fenced for w in run.workers] == [1, 0]
        [claim] = await run.claims()
        assert (claim.status, claim.owner) == ("completed", "worker-b")


@pytest.mark.parametrize("stage", ["handled", "completed"])
async def test_crash_points_hold_for_a_handler_whose_completion_is_batched(stage: Stage) -> None:
    """No ctx.db: the completion goes in a shared statement and `completed` runs in the batch's
    concluder; a crash there still leaves the outcome committed and the ack untold."""
    runs: list[str] = []
    app = App("crash")

    @app.handler("jobs", lease_s=30)
    async def work(job: Job) -> int:
        runs.append("run")
        return job.n

    async with TestRun(app, database_url=ADMIN_URL) as run:
        run.crash_at(stage)
        sent = run.publish("jobs", {"n": 4}, message_id="j-4")
        await run.idle()
        [claim] = await run.claims()
        assert (claim.status, claim.result) == ("completed", 4)
        assert [(s.consumer, s.fate) for s in sent.log] == [("b", "acked")]
        assert sent.log[0].duplicate is (stage == "completed")
        assert len(runs) == (1 if stage == "completed" else 2)
