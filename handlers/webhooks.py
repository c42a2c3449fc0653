"""The webhooks example: GitHub, Stripe, a Standard Webhooks sender and an API with
Idempotency-Key, received over HTTP and handled by a worker, each delivery once.

    export GITHUB_WEBHOOK_SECRET=... STRIPE_WEBHOOK_SECRET=whsec_... \\
           BILLING_WEBHOOK_SECRET=whsec_... ORDERS_API_KEYS=key-a=tenant-a,key-b=tenant-b
    dedupe-worker receive handlers.webhooks:app --port 8080     # HTTP -> broker
    dedupe-worker run     handlers.webhooks:app                 # broker -> handlers

Secrets are read from the environment when a request is verified (and checked once when
the receiver starts), never at import time; the worker needs none of them.
"""

from __future__ import annotations

import json
import os

import asyncpg

from dedupe import App, Context, Message
from dedupe.errors import ConfigurationError
from dedupe.webhooks import api_key, env, github, standard_webhooks, stripe

SCHEMA = """
CREATE TABLE IF NOT EXISTS webhook_events (
    id         bigserial PRIMARY KEY,
    message_id text NOT NULL,  -- no UNIQUE on purpose: a second delivery would show as a row
    source     text NOT NULL,
    kind       text NOT NULL,
    body       bytea NOT NULL
);
"""


def orders_api_keys() -> dict[str, str]:
    """ORDERS_API_KEYS="key=tenant,key2=tenant2" as {api_key: tenant}."""
    pairs = [item.partition("=") for item in os.environ.get("ORDERS_API_KEYS", "").split(",")]
    keys = {key.strip(): tenant.strip() for key, sep, tenant in pairs if sep}
    if not keys:
        raise ConfigurationError("set ORDERS_API_KEYS=key=tenant[,key=tenant...]")
    return keys


def make_app(*, prefix: str = "") -> App:
    """The example app; `prefix` keeps the channels of one test or benchmark apart."""
    app = App("hooks")
    app.webhook(
        "github", verify=github(secret=env("GITHUB_WEBHOOK_SECRET")), channel=f"{prefix}github"
    )
    app.webhook(
        "stripe", verify=stripe(secret=env("STRIPE_WEBHOOK_SECRET")), channel=f"{prefix}stripe"
    )
    app.webhook(
        "billing",
        verify=standard_webhooks(secret=env("BILLING_WEBHOOK_SECRET")),
        channel=f"{prefix}billing",
    )
    app.webhook("orders", verify=api_key(orders_api_keys), channel=f"{prefix}orders")

    async def record(source: str, kind: str, message: Message, ctx: Context) -> dict[str, str]:
        # ctx.db commits with the claim's outcome: one row per delivery, however often sent.
        await ctx.db.execute(
            "INSERT INTO webhook_events (message_id, source, kind, body) VALUES ($1, $2, $3, $4)",
            ctx.key,
            source,
            kind,
            message.body,
        )
        return {"recorded": ctx.key}

    def body_type(message: Message) -> str:
        try:
            event = json.loads(message.body)
        except ValueError:
            return "unknown"
        kind = event.get("type") if isinstance(event, dict) else None
        return kind if isinstance(kind, str) else "unknown"

    @app.handler(f"{prefix}github")
    async def github_event(message: Message, ctx: Context) -> dict[str, str]:
        return await record("github", message.headers.get("X-GitHub-Event", "?"), message, ctx)

    @app.handler(f"{prefix}stripe")
    async def stripe_event(message: Message, ctx: Context) -> dict[str, str]:
        return await record("stripe", body_type(message), message, ctx)

    @app.handler(f"{prefix}billing")
    async def billing_event(message: Message, ctx: Context) -> dict[str, str]:
        return await record("billing", body_type(message), message, ctx)

    @app.handler(f"{prefix}orders")
    async def order(message: Message, ctx: Context) -> dict[str, str]:
        tenant = message.headers.get("x-dedupe-webhook-tenant", "?")
        return await record("orders", f"order:{tenant}", message, ctx)

    return app


app = make_app()


async def setup(dsn: str) -> None:
    """Create the example's table (the claims table comes from `dedupe-worker migrate`)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()
