"""A stand-in for an external payment API (think Stripe): outside our transaction, so a call
can repeat after a crash; it honours the idempotency key we pass, as real providers do.

Every call is recorded in `provider_calls` so the demo and the tests can count them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os

import asyncpg

from dedupe.settings import DEFAULT_DATABASE_URL

SCHEMA = """
CREATE TABLE IF NOT EXISTS provider_calls (
    id              bigserial PRIMARY KEY,
    idempotency_key text        NOT NULL,
    payment_id      text        NOT NULL,
    amount_cents    bigint      NOT NULL,
    called_at       timestamptz NOT NULL DEFAULT now()
);
"""


class ProviderUnavailable(Exception):
    """The provider answered 503: try again later."""


class PaymentProvider:
    """Records each call; returns the same charge id for the same idempotency key."""

    def __init__(self) -> None:
        self._pool: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()

    async def _connection_pool(self) -> asyncpg.Pool:
        async with self._lock:
            if self._pool is None:
                dsn = os.environ.get("PROVIDER_DATABASE_URL") or os.environ.get(
                    "DEDUPE_DATABASE_URL", DEFAULT_DATABASE_URL
                )
                self._pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
            assert self._pool is not None
            return self._pool

    async def charge(self, *, idempotency_key: str, payment_id: str, amount_cents: int) -> str:
        pool = await self._connection_pool()
        await pool.execute(
            "INSERT INTO provider_calls (idempotency_key, payment_id, amount_cents)"
            " VALUES ($1, $2, $3)",
            idempotency_key,
            payment_id,
            amount_cents,
        )
        if payment_id.startswith("poison"):
            raise ProviderUnavailable(f"provider keeps failing for {payment_id}")
        return "ch_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]
