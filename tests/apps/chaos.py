"""The chaos suite's app: one database effect (through ctx.db) and one call to a stand-in
external service per key, plus a test hook that SIGKILLs the worker at a failpoint.

Keys come from the body (`id`) and tenants from the `X-Tenant` header, where hostile values
can live (an AMQP message id holds at most 255 bytes, a header or body much more). A body with
`"result": "nul" | "surrogate" | "nan"` makes the handler return a value jsonb cannot hold.

Test-only configuration, read when the module is imported by a worker process:
  CHAOS_CHANNEL      the channel (each scenario has its own)
  CHAOS_LEASE_S      the handler's lease
  CHAOS_FAILPOINT    claimed | handled | completed: where the hook may kill the worker
  CHAOS_GROUP_COMMIT 1: the handler runs with group_commit=True (runs share transactions)
  CHAOS_ONE_TRANSACTION 1: the handler runs with one_transaction=True (a first delivery's
                     claim, run and completion in one transaction)
  CHAOS_FUSE         a path the test creates when it wants the next kill: the first worker
                     to pass the failpoint while it exists takes it (an atomic rename) and
                     SIGKILLs itself, so the test paces the kills over the whole stream
  CHAOS_SLOW_FUSE    a path the test creates when it wants the next run to be slow: the first
                     run to start while it exists takes it (renamed to `<path>.taken-by-<pid>`,
                     so the test knows which worker) and sleeps CHAOS_SLOW_S seconds
"""

from __future__ import annotations

import asyncio
import os
import signal

import asyncpg
from pydantic import BaseModel

from dedupe import App, Context, Message
from dedupe.webhooks import api_key

app = App("chaos")
CHANNEL = os.environ.get("CHAOS_CHANNEL", "chaos")
LEASE_S = float(os.environ.get("CHAOS_LEASE_S", "2"))
SLOW_S = float(os.environ.get("CHAOS_SLOW_S", "3"))
API_KEY = "chaos-api-key"  # the receiver scenario's sender authenticates with it
SCOPE = f"{app.name}.work"  # the handler's scope; each tenant's claims are under SCOPE/<tenant>

# What the handler returns for a body's "result", and what jsonb holds of it.
HOSTILE_RESULTS: dict[str, object] = {"nul": "a\x00b", "surrogate": "a\ud800b", "nan": float("nan")}
STORED_RESULTS: dict[str, object] = {"nul": "a\ufffdb", "surrogate": "a\ufffdb", "nan": None}

# The receiver scenario: POST /webhooks/chaos with Idempotency-Key, forwarded to the channel.
# The receiver's lease must outlast its publish timeout (5 s).
app.webhook("chaos", verify=api_key({API_KEY: "t1"}), channel=CHANNEL, lease_s=6.0)


class Work(BaseModel):
    id: str
    v: int
    poison: bool = False
    sleep_s: float = 0.0
    result: str | None = None  # a key of HOSTILE_RESULTS


class PoisonError(Exception):
    """This message always fails."""


class ExternalService:
    """Records every call with the idempotency key it was given, outside our transaction."""

    def __init__(self) -> None:
        self._pool: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()

    async def call(self, *, idempotency_key: str, business_key: str) -> None:
        async with self._lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    os.environ["DEDUPE_DATABASE_URL"], min_size=1, max_size=4
                )
        assert self._pool is not None
        await self._pool.execute(
            "INSERT INTO chaos_external (business_key, idempotency_key, pid) VALUES ($1, $2, $3)",
            business_key,
            idempotency_key,
            os.getpid(),
        )


external = ExternalService()

_FAILPOINT = os.environ.get("CHAOS_FAILPOINT")
_FUSE = os.environ.get("CHAOS_FUSE", "")
_SLOW_FUSE = os.environ.get("CHAOS_SLOW_FUSE", "")


def _take(fuse: str) -> bool:
    """Take the fuse if it is there (an atomic rename: only one process gets it)."""
    try:
        os.rename(fuse, f"{fuse}.taken-by-{os.getpid()}")
    except FileNotFoundError:
        return False  # not wanted now, or another worker took it
    return True


@app.handler(
    CHANNEL,
    key="body:id",
    scope="header:X-Tenant",
    lease_s=LEASE_S,
    max_attempts=5,
    backoff_s=0.05,
    max_backoff_s=0.2,
    group_commit=os.environ.get("CHAOS_GROUP_COMMIT") == "1",
    one_transaction=os.environ.get("CHAOS_ONE_TRANSACTION") == "1",
)
async def work(payload: Work, ctx: Context) -> int | dict[str, object]:
    if payload.poison:
        raise PoisonError(f"{payload.id} always fails")
    if _SLOW_FUSE and _take(_SLOW_FUSE):
        await asyncio.sleep(SLOW_S)
    await asyncio.sleep(payload.sleep_s)
    await external.call(idempotency_key=ctx.key, business_key=payload.id)
    await ctx.db.execute(
        "INSERT INTO chaos_effects (business_key, v, pid) VALUES ($1, $2, $3)",
        payload.id,
        payload.v,
        os.getpid(),
    )
    if payload.result is not None:
        return {"v": payload.v, "note": HOSTILE_RESULTS[payload.result]}
    return payload.v


def install_failpoint(target: App) -> None:
    """If CHAOS_FAILPOINT and CHAOS_FUSE are set, a hook at that failpoint of `target` that
    SIGKILLs its worker when it takes the fuse."""
    if not (_FAILPOINT and _FUSE):
        return

    @target.hook(_FAILPOINT)
    async def failpoint(stage: str, message: Message, scope: str, key: str) -> None:
        if _take(_FUSE):
            os.kill(os.getpid(), signal.SIGKILL)


install_failpoint(app)


SCHEMA = """
CREATE TABLE IF NOT EXISTS chaos_effects (
    business_key text NOT NULL, v int NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_external (
    business_key text NOT NULL, idempotency_key text NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
