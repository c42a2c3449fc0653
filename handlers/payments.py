"""The payments example: charge once per payment, however often the request is delivered.

    dedupe-worker run handlers.payments:app

`charges` is written through ctx.db, so it commits atomically with the claim's outcome
(exactly once). The provider is external: it may be called again after a crash, always with
the same idempotency key (ctx.key), so it charges the card once.
"""

from __future__ import annotations

import asyncpg
from pydantic import BaseModel, Field

from dedupe import App, Context

from .provider import SCHEMA as PROVIDER_SCHEMA
from .provider import PaymentProvider

app = App("shop")
provider = PaymentProvider()

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    payment_id      text PRIMARY KEY,
    customer        text   NOT NULL,
    amount_cents    bigint NOT NULL,
    charge_id       text   NOT NULL,
    idempotency_key text   NOT NULL
);
"""


class ChargeRequested(BaseModel):
    payment_id: str
    customer: str
    amount_cents: int = Field(gt=0)


@app.handler(
    "payments",
    key="message_id",
    lease_s=10,
    max_attempts=3,
    backoff_s=0.05,
    max_backoff_s=0.5,
)
async def charge(event: ChargeRequested, ctx: Context) -> dict[str, str]:
    charge_id = await provider.charge(
        idempotency_key=ctx.key, payment_id=event.payment_id, amount_cents=event.amount_cents
    )
    await ctx.db.execute(
        "INSERT INTO charges (payment_id, customer, amount_cents, charge_id, idempotency_key)"
        " VALUES ($1, $2, $3, $4, $5)",
        event.payment_id,
        event.customer,
        event.amount_cents,
        charge_id,
        ctx.key,
    )
    return {"charge_id": charge_id}


async def setup(dsn: str) -> None:
    """Create the example's own tables (the claims table comes from `dedupe-worker migrate`)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(SCHEMA + PROVIDER_SCHEMA)
    finally:
        await conn.close()
