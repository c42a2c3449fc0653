"""The payments example: charge once per payment, however often the request is delivered,
and send its receipt once.

    dedupe-worker run handlers.payments:app

`charges` is written through ctx.db, so it commits atomically with the claim's outcome
(exactly once). The provider is external, so its call is a durable step: its answer is
recorded as soon as it returns, and a re-run of the payment after a crash or a take-over gets
the recorded charge instead of calling again. Only a run killed inside the call (after the
provider took it, before its answer was recorded) calls again, with the same idempotency key
(`f"{ctx.key}/charge"`), so the provider charges the card once. The receipt goes out through
the outbox (in the completion transaction, relayed after the commit) to the `receipts`
channel, where a second handler records it, once per receipt message id.
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
-- One row per receipt handled; no unique index, so that a receipt handled twice would show.
CREATE TABLE IF NOT EXISTS receipts (
    payment_id   text        NOT NULL,
    message_id   text        NOT NULL,
    charge_id    text        NOT NULL,
    amount_cents bigint      NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now()
);
"""
RECEIPTS = "receipts"


class ChargeRequested(BaseModel):
    payment_id: str
    customer: str
    amount_cents: int = Field(gt=0)


class Receipt(BaseModel):
    payment_id: str
    charge_id: str
    amount_cents: int


@app.handler(
    "payments",
    key="message_id",
    lease_s=10,
    max_attempts=3,
    backoff_s=0.05,
    max_backoff_s=0.5,
)
async def charge(event: ChargeRequested, ctx: Context) -> dict[str, str]:
    idempotency_key = f"{ctx.key}/charge"  # the step's own key for the provider
    charge_id: str = await ctx.step(
        "charge",
        provider.charge,
        idempotency_key=idempotency_key,
        payment_id=event.payment_id,
        amount_cents=event.amount_cents,
    )
    await ctx.db.execute(
        "INSERT INTO charges (payment_id, customer, amount_cents, charge_id, idempotency_key)"
        " VALUES ($1, $2, $3, $4, $5)",
        event.payment_id,
        event.customer,
        event.amount_cents,
        charge_id,
        idempotency_key,
    )
    await ctx.publish(
        RECEIPTS,
        Receipt(payment_id=event.payment_id, charge_id=charge_id, amount_cents=event.amount_cents),
    )
    return {"charge_id": charge_id}


@app.handler(RECEIPTS, lease_s=10, max_attempts=3, backoff_s=0.05, max_backoff_s=0.5)
async def receipt(event: Receipt, ctx: Context) -> None:
    """Record the receipt (think: e-mail it); a relay repeat is a duplicate by its message id."""
    await ctx.db.execute(
        "INSERT INTO receipts (payment_id, message_id, charge_id, amount_cents)"
        " VALUES ($1, $2, $3, $4)",
        event.payment_id,
        ctx.message.message_id,
        event.charge_id,
        event.amount_cents,
    )


async def setup(dsn: str) -> None:
    """Create the example's own tables (the claims table comes from `dedupe-worker migrate`)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(SCHEMA + PROVIDER_SCHEMA)
    finally:
        await conn.close()
