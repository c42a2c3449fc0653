"""A message whose handler takes a ctx leaves no reference cycle of dedupe's objects behind, on
the completing path of each mode a run with ctx.db takes (its own transaction, a group commit's
lane, one transaction with the claim): its effects, transaction and context go by reference
counting as the run ends, not by the cyclic GC (a cycle per message was about 10 us of a
`ctx.db` message's CPU, `python -m bench.core --handler insert`). As the HTTP API's
(test_http_api_garbage.py)."""

from __future__ import annotations

import gc
import json

import asyncpg
import pytest

from dedupe import App, Context
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action
from tests.garbage import ours, saved_garbage

CH = "rows"
MODES = {
    "own transaction": {},
    "group commit": {"group_commit": True},
    "one transaction": {"one_transaction": True},
}


def deliveries(prefix: str, count: int) -> list[MemoryDelivery]:
    return [
        MemoryDelivery(
            make_message(
                CH, json.dumps({"n": i}), message_id=f"{prefix}{i}", meta={"redelivered": False}
            )
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("publishes", [False, True], ids=["writes", "writes and publishes"])
async def test_a_ctx_db_run_leaves_no_cycle_of_ours(
    mode: str, publishes: bool, store: ClaimStore, db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (key text PRIMARY KEY)")
    app = App("s")

    @app.handler(CH, retry_on=(), **MODES[mode])  # type: ignore[arg-type]
    async def write(payload: dict[str, int], ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1)", ctx.key)
        if publishes:
            await ctx.publish("elsewhere", b"{}")

    async with Processor(app, store) as processor:
        warm = deliveries("warm", 2)  # prepared statements, pool connections, lanes
        await processor.process(CH, warm)
        batch = deliveries("k", 4)
        with saved_garbage() as garbage:
            await processor.process(CH, batch)
            gc.collect()
            left = ours(garbage)
    assert [d.outcome.action for d in warm + batch if d.outcome] == [Action.ACK] * 6
    assert await db.fetchval("SELECT count(*) FROM effects") == 6
    assert left == []
