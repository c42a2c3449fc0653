"""bench.apps.naive_receiver, one of bench.receiver's baselines: the hand-written webhook
receiver with the check users write by hand. On a real PostgreSQL and RabbitMQ, in-process: a
new delivery is published once and remembered, the same delivery again is answered 202 without
a publish, and a bad signature publishes nothing."""

from __future__ import annotations

import hashlib
import hmac

import aio_pika
import asyncpg
import httpx
import pytest

from bench import apps, baselines, http_core

SECRET = "naive-test-secret"
BODY = b'{"ref": "refs/heads/main"}'


def signed(delivery: str, body: bytes = BODY) -> dict[str, str]:
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {
        "Content-Type": "application/json",
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": delivery,
        "X-Hub-Signature-256": f"sha256={signature}",
    }


async def queued(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        declared = await amqp.declare_queue(queue, durable=True, passive=True)
        return int(declared.declaration_result.message_count or 0)


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
                (await client.post("/webhooks/github", content=BODY, headers=signed(d))).status_code
                for d in ("d-1", "d-1", "d-2")
            ]
            forged = {**signed("d-3"), "X-Hub-Signature-256": "sha256=" + "0" * 64}
            refused = await client.post("/webhooks/github", content=BODY, headers=forged)
    assert statuses == [202, 202, 202]
    assert refused.status_code == 401
    assert await queued(amqp_url, channel) == 2
    remembered = await db.fetch("SELECT key FROM bench_processed ORDER BY key")
    assert [r["key"] for r in remembered] == ["d-1", "d-2"]
