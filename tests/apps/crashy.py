"""A test app for worker processes: writes one effect per key; `{"crash": true}` kills the
worker outright (a poison message that no try/except can catch).

Test-only: the channel and lease come from CRASHY_CHANNEL / CRASHY_LEASE_S so that each test
gets its own queue. With CRASHY_STARTED_DIR set, a run touches a file named after its key there
as it starts (outside its transaction): the tests' sign that a handler runs, which a claim in
progress is not (a claim not started yet is given back at a stop). The file holds the worker's
gc.get_freeze_count() at that moment (the start-up heap `dedupe-worker run` froze).
"""

from __future__ import annotations

import asyncio
import gc
import os
import urllib.parse
from pathlib import Path

from pydantic import BaseModel

from dedupe import App, Context

app = App("crashy")
STARTED_DIR = os.environ.get("CRASHY_STARTED_DIR")


class Work(BaseModel):
    n: int = 0
    crash: bool = False
    sleep_s: float = 0.0


@app.handler(
    os.environ.get("CRASHY_CHANNEL", "crashy"),
    lease_s=float(os.environ.get("CRASHY_LEASE_S", "2")),
    max_attempts=3,
    backoff_s=0.05,
    max_backoff_s=0.2,
)
async def work(payload: Work, ctx: Context) -> int:
    if payload.crash:
        os._exit(17)
    if STARTED_DIR:
        started = Path(STARTED_DIR, urllib.parse.quote(ctx.key, safe=""))
        await asyncio.to_thread(started.write_text, str(gc.get_freeze_count()))
    await asyncio.sleep(payload.sleep_s)
    await ctx.db.execute(
        "INSERT INTO effects (key, n, pid) VALUES ($1, $2, $3)", ctx.key, payload.n, os.getpid()
    )
    return payload.n
