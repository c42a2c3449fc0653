"""`async with ctx.db.transaction():` a savepoint in the run's transaction, on every path a run
takes (its own transaction, a group commit's lane, one transaction with the claim): a block that
raises is rolled back to its savepoint, with the publishes made in it; a statement PostgreSQL
refused inside it no longer spoils the run; the run's other writes commit with its outcome. A
cancellation during a block's rollback spoils nothing else, and a group-commit member whose
connection is lost at its RELEASE is still settled."""

from __future__ import annotations

import asyncio
import contextlib
import json

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action

CH = "rows"
MODES = {
    "own transaction": {},
    "group commit": {"group_commit": True},
    "one transaction": {"one_transaction": True},
}


class Row(BaseModel):
    n: int


@pytest.fixture
async def effects(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE effects (key text PRIMARY KEY, n int NOT NULL)")
    return db


def app_for(mode: str, blocks: list[str]) -> App:
    app = App("s")

    @app.handler(CH, retry_on=(), **MODES[mode])  # type: ignore[arg-type]
    async def write(payload: Row, ctx: Context) -> dict[str, int]:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        # A block whose second statement PostgreSQL refuses, the error caught outside it.
        with contextlib.suppress(asyncpg.UniqueViolationError):
            async with ctx.db.transaction():
                await ctx.db.execute("INSERT INTO effects VALUES ($1, 0)", f"{ctx.key}-undone")
                await ctx.db.execute("INSERT INTO effects VALUES ($1, 0)", ctx.key)
        blocks.append("failed")
        # A block that raises on its own, and two nested blocks that end.
        with contextlib.suppress(LookupError):
            async with ctx.db.transaction():
                await ctx.db.execute("INSERT INTO effects VALUES ($1, 0)", f"{ctx.key}-raised")
                raise LookupError("changed my mind")
        async with ctx.db.transaction():
            await ctx.db.execute("INSERT INTO effects VALUES ($1, 1)", f"{ctx.key}-kept")
            async with ctx.db.transaction():
                await ctx.db.execute("INSERT INTO effects VALUES ($1, 2)", f"{ctx.key}-nested")
        return {"n": payload.n}

    return app


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_block_that_fails_is_rolled_back_and_the_run_completes(
    mode: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    deliveries = [
        MemoryDelivery(
            make_message(CH, json.dumps({"n": i}), message_id=f"k{i}", meta={"redelivered": False})
        )
        for i in range(4)
    ]
    blocks: list[str] = []
    async with Processor(app_for(mode, blocks), store) as processor:
        await processor.process(CH, deliveries)
        # Each run went the mode's own way: none fell back to a transaction of its own.
        assert not processor.stats.one_transaction_fallbacks
    assert {d.message.message_id: d.settlements[-1].action for d in deliveries} == {
        f"k{i}": Action.ACK for i in range(4)
    }
    assert len(blocks) == 4
    rows = {r["key"] for r in await effects.fetch("SELECT key FROM effects")}
    assert rows == {f"k{i}{end}" for i in range(4) for end in ("", "-kept", "-nested")}
    statuses = await effects.fetch("SELECT DISTINCT status FROM dedupe_claims")
    assert [r["status"] for r in statuses] == ["completed"]


async def test_a_block_outside_a_run_is_refused(store: ClaimStore) -> None:
    """After the run, ctx.db is closed: a block says so instead of touching a pooled
    connection."""
    from dedupe.context import Database

    db = Database(store.pool)
    await db.close()
    with pytest.raises(RuntimeError, match="closed"):
        async with db.transaction():
            pass


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_publish_inside_a_block_that_raised_is_rolled_back_with_it(
    mode: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    app = App("s")

    @app.handler(CH, retry_on=(), **MODES[mode])  # type: ignore[arg-type]
    async def write(payload: Row, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        with contextlib.suppress(asyncpg.UniqueViolationError):
            async with ctx.db.transaction():
                await ctx.publish("created", {"key": ctx.key}, key=f"{ctx.key}-created")
                await ctx.db.execute("INSERT INTO effects VALUES ($1, 0)", ctx.key)  # refused
        await ctx.publish("kept", {"key": ctx.key}, key=f"{ctx.key}-kept")

    delivery = MemoryDelivery(
        make_message(CH, json.dumps({"n": 1}), message_id="k1", meta={"redelivered": False})
    )
    async with Processor(app, store) as processor:
        await processor.process(CH, [delivery])
    assert delivery.settlements[-1].action is Action.ACK
    rows = {r["key"] for r in await effects.fetch("SELECT key FROM effects")}
    assert rows == {"k1"}  # the block's insert was rolled back...
    published = sorted(
        r["message_id"] for r in await effects.fetch("SELECT message_id FROM dedupe_outbox")
    )
    # ... and so must be the publish made in it: only the one after the block goes out.
    assert published == ["k1-kept"]


async def test_a_timeout_that_expires_while_a_block_rolls_back_spoils_nothing_else(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A handler's own `asyncio.timeout` expires while its failed block's ROLLBACK TO SAVEPOINT
    is on the wire (made deterministic here: the deadline is moved to now as the block raises).
    The shielded rollback goes on in the background while the run goes on: the next statement
    on the lane's connection must not meet it ("another operation is in progress"), which
    broke the lane: the other members of its group were failed with it, and the run's own
    completion future was never resolved (its message never settled)."""
    app = App("g")

    @app.handler(CH, group_commit=True, retry_on=(), lease_s=30)
    async def write(payload: Row, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        if ctx.key == "k1":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None) as deadline:
                    async with ctx.db.transaction():
                        await ctx.db.execute("INSERT INTO effects VALUES ('k1-undone', 0)")
                        deadline.reschedule(asyncio.get_running_loop().time())
                        raise LookupError("changed my mind")
            # The run goes on (the block was rolled back), on its connection.
            await ctx.db.execute("INSERT INTO effects VALUES ('k1-after', 0)")
        await asyncio.sleep(0.05)  # the runs behind this one join its group

    deliveries = [
        MemoryDelivery(make_message(CH, json.dumps({"n": i}), message_id=f"k{i}")) for i in range(4)
    ]
    async with Processor(app, store) as processor:
        async with asyncio.timeout(20):
            await processor.process(CH, deliveries)
    assert {d.message.message_id: d.settlements[-1].action for d in deliveries} == {
        f"k{i}": Action.ACK for i in range(4)
    }
    rows = {r["key"] for r in await effects.fetch("SELECT key FROM effects")}
    assert rows == {f"k{i}" for i in range(4)} | {"k1-after"}


async def test_a_lane_connection_lost_at_the_members_release_still_settles_the_member(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """(Not from this range: group_commit.Lane.finished.) The lane's connection is lost after
    the handler's last statement: the member's RELEASE SAVEPOINT fails, Lane._fail fails the
    open group, but the member's own completion future (not in the group yet) was never
    resolved: its message was never settled and process() never returned."""
    app = App("g")

    @app.handler(CH, group_commit=True, retry_on=(), lease_s=30)
    async def write(payload: Row, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        pid = await ctx.db.fetchval("SELECT pg_backend_pid()")
        await effects.execute("SELECT pg_terminate_backend($1)", pid)

    delivery = MemoryDelivery(make_message(CH, json.dumps({"n": 1}), message_id="k1"))
    async with Processor(app, store) as processor:
        async with asyncio.timeout(20):
            await processor.process(CH, [delivery])
    assert delivery.settlements[-1].action is Action.REQUEUE  # the store failed under it
