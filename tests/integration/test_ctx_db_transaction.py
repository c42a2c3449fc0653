"""`async with ctx.db.transaction():` a savepoint in the run's transaction, on every path a run
takes (its own transaction, a group commit's lane, one transaction with the claim): a block that
raises is rolled back to its savepoint, a statement PostgreSQL refused inside it no longer
spoils the run, the run's other writes commit with its outcome."""

from __future__ import annotations

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
