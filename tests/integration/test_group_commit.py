"""Group commit (`group_commit=True`) against a real PostgreSQL: the runs of a group share one
COMMIT, and still one failing run, or one whose key was taken over, harms no other."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.records import Reason
from dedupe.claims.store import ClaimStore
from dedupe.errors import ConfigurationError
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action
from tests.conftest import eventually

CH = "rows"


class Row(BaseModel):
    n: int


def batch(count: int, prefix: str = "k") -> list[MemoryDelivery]:
    return [
        MemoryDelivery(make_message(CH, json.dumps({"n": i}), message_id=f"{prefix}{i}"))
        for i in range(count)
    ]


@pytest.fixture
async def effects(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE effects (key text PRIMARY KEY, n int NOT NULL)")
    return db


def grouped_app(hold_s: float = 0.0, **behaviour: str) -> App:
    """A grouped handler writing one row (then holding its lane `hold_s`, so that the runs
    behind it join its group); `behaviour[key]` makes that key's run misbehave."""
    app = App("g")

    @app.handler(CH, group_commit=True, retry_on=(), lease_s=30)
    async def write(payload: Row, ctx: Context) -> dict[str, int]:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        await asyncio.sleep(hold_s)
        what = behaviour.get(ctx.key)
        if what == "raise":
            raise RuntimeError("this run fails after its write")
        if what == "violate":  # a statement PostgreSQL refuses, not caught
            await ctx.db.execute("INSERT INTO effects VALUES ($1, 0)", ctx.key)
        if what == "swallow":  # refused and caught: the transaction is aborted all the same
            with contextlib.suppress(asyncpg.UniqueViolationError):
                await ctx.db.execute("INSERT INTO effects VALUES ($1, 0)", ctx.key)
        if what == "timeout":  # a statement cut off by its timeout, the error caught
            with contextlib.suppress(TimeoutError):
                await ctx.db.execute("SELECT pg_sleep(5)", timeout=0.05)
        if what == "taken":  # another worker takes this key over before the group commits
            conn = await asyncpg.connect(app_dsn["url"])
            try:
                await conn.execute(
                    "UPDATE dedupe_claims SET token = nextval('dedupe_claim_tokens'),"
                    " owner = 'other', lease_until = now() + interval '1 minute'"
                    " WHERE key = $1",
                    ctx.key,
                )
            finally:
                await conn.close()
        return {"n": payload.n}

    return app


app_dsn: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _dsn(db_url: str) -> None:
    app_dsn["url"] = db_url


def actions(deliveries: list[MemoryDelivery]) -> Mapping[str, Action]:
    return {d.message.message_id or "": d.settlements[-1].action for d in deliveries}


async def test_a_failing_run_in_a_group_of_fifty_leaves_the_other_49_committed(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """One run raises after its write, one violates a constraint: only their writes roll back
    (to their savepoints); both are dead-lettered; the other 48 are committed and acked."""
    deliveries = batch(50)
    async with Processor(grouped_app(k7="raise", k30="violate"), store) as processor:
        await processor.process(CH, deliveries)
    outcome = actions(deliveries)
    assert outcome.pop("k7") is outcome.pop("k30") is Action.DEAD_LETTER
    assert set(outcome.values()) == {Action.ACK}
    keys = {r["key"] for r in await effects.fetch("SELECT key FROM effects")}
    assert keys == {f"k{i}" for i in range(50)} - {"k7", "k30"}
    reasons = {
        d.settlements[-1].reason for d in deliveries if d.message.message_id in ("k7", "k30")
    }
    assert reasons == {Reason.HANDLER_ERROR}
    completed = await effects.fetchval(
        "SELECT count(*) FROM dedupe_claims WHERE status = 'completed'"
    )
    assert completed == 48


async def test_the_runs_of_a_group_share_commits(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Two hundred runs on four lanes commit in far fewer transactions than runs."""
    before = await effects.fetchval(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    )
    async with Processor(grouped_app(), store, concurrency=32) as processor:
        await asyncio.gather(*(processor.process(CH, batch(50, f"b{i}-")) for i in range(4)))
    await asyncio.sleep(0.6)  # the statistics collector's reporting delay
    after = await effects.fetchval(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    )
    assert await effects.fetchval("SELECT count(*) FROM effects") == 200
    # Each run alone: claims, completions and 200 transactions of its own; grouped: far fewer.
    assert after - before < 150
    # The worker counts its groups and their members (dedupe_group_commits and
    # dedupe_group_commit_members): every run completed in some group, in fewer groups than runs.
    stats = processor.stats
    assert stats.group_members_committed == 200
    assert 0 < stats.groups_committed < 100


async def test_a_member_taken_over_writes_nothing_and_the_others_run_again_once(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Another worker takes one member's key over before its group commits: the fence refuses
    it, that group rolls back (the fenced run writes nothing), its other members are given
    back and requeued; run again, each completes once. Groups before it committed as usual."""
    first = batch(10)
    # Ten runs on four lanes, each holding its lane a moment: every lane's group has several.
    async with Processor(grouped_app(hold_s=0.1, k3="taken"), store) as processor:
        await processor.process(CH, first)
        outcome = actions(first)
        assert outcome.pop("k3") is Action.DEFER  # lease lost
        requeued = {key for key, action in outcome.items() if action is Action.REQUEUE}
        assert requeued and set(outcome.values()) <= {Action.ACK, Action.REQUEUE}
        assert "k3" not in {r["key"] for r in await effects.fetch("SELECT key FROM effects")}
        assert processor.stats.fenced == 1
        again = [d for d in batch(10) if d.message.message_id in requeued]
        await processor.process(CH, again)
        assert set(actions(again).values()) == {Action.ACK}
    keys = [r["key"] for r in await effects.fetch("SELECT key FROM effects")]
    assert sorted(keys) == sorted(f"k{i}" for i in range(10) if i != 3)
    # The rolled-back runs were given back with their attempt: running again counts one run.
    attempts = await effects.fetch("SELECT attempts FROM dedupe_claims WHERE key <> 'k3'")
    assert {r["attempts"] for r in attempts} == {1}


async def test_a_run_that_swallows_a_refused_statement_cannot_complete_in_its_group(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A handler that catches the error of a statement PostgreSQL refused has an aborted
    transaction: it is requeued as a store failure (its writes rolled back), the others commit."""
    deliveries = batch(5)
    async with Processor(grouped_app(k2="swallow"), store) as processor:
        await processor.process(CH, deliveries)
    outcome = actions(deliveries)
    assert outcome.pop("k2") is Action.REQUEUE
    assert set(outcome.values()) == {Action.ACK}
    keys = {r["key"] for r in await effects.fetch("SELECT key FROM effects")}
    assert keys == {"k0", "k1", "k3", "k4"}


async def test_a_run_whose_statement_timed_out_cannot_complete_in_its_group(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A statement cut off by its timeout (the handler caught the error) leaves the group's
    transaction aborted: that run is requeued, its writes rolled back; the others commit."""
    deliveries = batch(5)
    async with Processor(grouped_app(k1="timeout"), store) as processor:
        await processor.process(CH, deliveries)
    outcome = actions(deliveries)
    assert outcome.pop("k1") is Action.REQUEUE
    assert set(outcome.values()) == {Action.ACK}
    keys = {r["key"] for r in await effects.fetch("SELECT key FROM effects")}
    assert keys == {"k0", "k2", "k3", "k4"}


async def test_group_commit_needs_a_handler_that_takes_a_context() -> None:
    """group_commit=True on a handler without ctx is refused at registration."""
    app = App("g")
    with pytest.raises(ConfigurationError, match="group_commit"):

        @app.handler(CH, group_commit=True)
        async def plain(payload: Row) -> None:
            pass


async def test_a_groups_publishes_are_relayed_once_committed(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Publishes of grouped runs go out after the group's COMMIT; a failed run's do not."""
    sent: list[str] = []

    class Recording:
        async def publish(
            self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
        ) -> None:
            sent.append(json.loads(body)["key"])

        async def close(self) -> None:
            pass

    app = App("g")

    @app.handler(CH, group_commit=True, retry_on=())
    async def write(payload: Row, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        await ctx.publish("next", {"key": ctx.key})
        if payload.n == 4:
            raise RuntimeError("no")

    async with Processor(app, store, publisher=Recording()) as processor:
        await processor.process(CH, batch(8))

        async def relayed() -> bool:
            return len(sent) == 7

        await eventually(relayed, timeout_s=5)
    assert sorted(sent) == sorted(f"k{i}" for i in range(8) if i != 4)
