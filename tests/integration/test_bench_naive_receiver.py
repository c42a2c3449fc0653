"""bench.apps.naive_receiver, one of bench.receiver's baselines: the hand-written webhook
receiver with the check users write by hand. On a real PostgreSQL and RabbitMQ, in-process: a
new delivery is published once and remembered, the same delivery again is answered 202 without
a publish, and a bad signature publishes nothing."""

from __future__ import annotations

import asyncpg
import httpx
import pytest

from bench import apps, baselines, http_core
from tests.integration.test_receiver import github_request, queue_depth

SECRET = "naive-test-secret"
BODY = b'{"ref": "refs/heads/main"}'


async def test_the_naive_receiver_publishes_each_delivery_once(
    db_url: str,
    db: asyncpg.Connection,
    amqp_url: str,
    channel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await db.execute(baselines.NAIVE_TABLE)
    monkeypatch.setenv("GITHUB_WEBHOOK_SECRET", SECRET)
    monkeypatch.setenv("BENCH_AMQP_URL", amqp_url)
    monkeypatch.setenv("BENCH_QUEUE", channel)
    monkeypatch.setenv("BENCH_DATABASE_URL", db_url)
    app = apps.naive_receiver()
    async with http_core.Lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            statuses = [
                (
                    await client.post(
                        "/webhooks/github",
                        content=BODY,
                        headers=github_request(BODY, d, secret=SECRET),
                    )
                ).status_code
                for d in ("d-1", "d-1", "d-2")
            ]
            forged = github_request(BODY, "d-3", secret="another-secret")
            refused = await client.post("/webhooks/github", content=BODY, headers=forged)
    assert statuses == [202, 202, 202]
    assert refused.status_code == 401
    assert await queue_depth(amqp_url, channel) == 2
    remembered = await db.fetch("SELECT key FROM bench_processed ORDER BY key")
    assert [r["key"] for r in remembered] == ["d-1", "d-2"]
