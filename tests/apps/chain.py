"""The chaos suite's two-stage chain: stage A (`work`, on CHAOS_CHANNEL) calls the stand-in
external service through a durable step, writes its effect through ctx.db and publishes the
order through the outbox to stage B (`deliver`, on CHAIN_NEXT), which writes an effect of its
own. A takes the chaos app's workload as it is (keys from the body, tenants from X-Tenant,
poison, hostile values); B dedupes by the message id the outbox derived for A's publish, so a
relay repeat or A's re-run is a duplicate there.

Test-only configuration, read when the module is imported by a worker process:
  CHAOS_CHANNEL, CHAOS_LEASE_S, CHAOS_FAILPOINT, CHAOS_FUSE   as in tests/apps/chaos.py (the
                     failpoint hook fires in either stage, whichever passes it first)
  CHAIN_NEXT         stage B's channel
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from dedupe import App, Context
from tests.apps.chaos import HOSTILE_RESULTS, ExternalService, PoisonError, Work, install_failpoint

app = App("chain")
CHANNEL = os.environ.get("CHAOS_CHANNEL", "chain")
NEXT = os.environ.get("CHAIN_NEXT", f"{CHANNEL}-b")
LEASE_S = float(os.environ.get("CHAOS_LEASE_S", "2"))
SCOPE = f"{app.name}.work"  # stage A's scope; each tenant's claims are under SCOPE/<tenant>
NEXT_SCOPE = f"{app.name}.deliver"

external = ExternalService()


class Order(BaseModel):
    id: str
    v: int


@app.handler(
    CHANNEL,
    key="body:id",
    scope="header:X-Tenant",
    lease_s=LEASE_S,
    max_attempts=5,
    backoff_s=0.05,
    max_backoff_s=0.2,
)
async def work(payload: Work, ctx: Context) -> int | dict[str, object]:
    if payload.poison:
        raise PoisonError(f"{payload.id} always fails")
    # A step: a re-run after a crash (or a take-over) does not call the service again.
    await ctx.step(
        "external",
        external.call,
        idempotency_key=f"{ctx.key}/external",
        business_key=payload.id,
    )
    await ctx.db.execute(
        "INSERT INTO chaos_effects (business_key, v, pid) VALUES ($1, $2, $3)",
        payload.id,
        payload.v,
        os.getpid(),
    )
    await ctx.publish(NEXT, Order(id=payload.id, v=payload.v))
    if payload.result is not None:
        return {"v": payload.v, "note": HOSTILE_RESULTS[payload.result]}
    return payload.v


@app.handler(NEXT, lease_s=LEASE_S, max_attempts=5, backoff_s=0.05, max_backoff_s=0.2)
async def deliver(order: Order, ctx: Context) -> None:
    await ctx.db.execute(
        "INSERT INTO chain_effects (business_key, message_id, v, pid) VALUES ($1, $2, $3, $4)",
        order.id,
        ctx.message.message_id,
        order.v,
        os.getpid(),
    )


install_failpoint(app)


SCHEMA = """
CREATE TABLE IF NOT EXISTS chain_effects (
    business_key text NOT NULL, message_id text, v int NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
