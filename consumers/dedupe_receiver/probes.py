"""The receiver's readiness: can PostgreSQL and the broker be reached (GET /readyz)."""

from __future__ import annotations

import asyncio
import json

from starlette.responses import Response

from dedupe.asgi.problems import UNAVAILABLE_RETRY_AFTER_S, Problem
from dedupe.claims.store import ClaimStore
from dedupe.transport import Publisher
from dedupe_receiver.replies import respond


async def readiness(
    store: ClaimStore | None, publisher: Publisher | None, *, publish_timeout_s: float
) -> Response:
    """200 with each check's state, or a 503 problem naming the ones that failed."""
    checks = {
        "postgresql": await store_ready(store),
        "broker": await broker_ready(publisher, publish_timeout_s),
    }
    if all(state in ("ok", "unchecked") for state in checks.values()):
        body = json.dumps({"status": "ready", "checks": checks}, separators=(",", ":"))
        return Response(body, media_type="application/json")
    return respond(
        Problem(
            503,
            "not-ready",
            "Not ready",
            "PostgreSQL or the broker cannot be reached",
            UNAVAILABLE_RETRY_AFTER_S,
            extensions={"checks": checks},
        )
    )


async def store_ready(store: ClaimStore | None) -> str:
    if store is None:
        return "not started"
    try:
        async with asyncio.timeout(2):
            await store.pool.fetchval("SELECT 1")
    except Exception:
        return "unavailable"
    return "ok"


async def broker_ready(publisher: Publisher | None, timeout_s: float) -> str:
    if publisher is None:
        return "not started"
    ready = getattr(publisher, "ready", None)
    if ready is None:
        return "unchecked"  # the publisher cannot tell (no ready()); publishes will
    try:
        async with asyncio.timeout(timeout_s):
            return "ok" if await ready() else "unavailable"
    except Exception:
        return "unavailable"


__all__ = ["broker_ready", "readiness", "store_ready"]
