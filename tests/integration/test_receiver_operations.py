"""The receiver's /metrics and /status, and who may release a key from the page."""

from __future__ import annotations

import json

import asyncpg
import httpx
import pytest

from consumers.receiver import create_receiver
from dedupe.app import App
from dedupe.store import ClaimStore
from tests.integration.test_receiver import (  # noqa: F401 - fixtures
    CountingPublisher,
    github_request,
    hooks,
    publisher,
    secrets,
)


def http(asgi: object, client_host: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=asgi, client=(client_host, 40000))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://receiver")


@pytest.fixture
async def stuck(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute(
        """INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, lease_until,
                                      created_at, expires_at)
           VALUES ('shop.charge', 'k-1', '\\x00', 'in_progress', 'gone', now(),
                   now() - interval '1 hour', now() + interval '1 day')"""
    )
    return db


async def test_metrics_count_webhook_outcomes(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
) -> None:
    """/metrics serves the receiver's counters in the Prometheus text format."""
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    body = json.dumps({"ref": "main"}).encode()
    async with http(receiver) as client:
        for _ in range(3):
            sent = await client.post(
                "/webhooks/github", content=body, headers=github_request(body, "d-1")
            )
            assert sent.status_code == 202
        metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'dedupe_webhook_requests_total{outcome="accepted"} 1.0' in metrics.text
    assert 'dedupe_webhook_requests_total{outcome="replayed"} 2.0' in metrics.text


async def test_without_a_token_only_loopback_clients_may_release(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    form = {"scope": "shop.charge", "key": "k-1"}
    async with http(receiver, "10.1.2.3") as remote:
        page = await remote.get("/status")
        assert page.status_code == 200 and "k-1" in page.text
        assert "class='release'" not in page.text
        assert (await remote.post("/status/release", data=form)).status_code == 403
    async with http(receiver) as local:
        evil = await local.post(
            "/status/release", data=form, headers={"origin": "http://evil.example"}
        )
        assert evil.status_code == 403
        assert await stuck.fetchval("SELECT retryable FROM dedupe_claims") is False
        done = await local.post("/status/release", data=form)
        assert done.status_code == 303
        assert "released=shop.charge" in done.headers["location"]
    assert await stuck.fetchval("SELECT retryable FROM dedupe_claims") is True


async def test_with_a_token_releasing_needs_it_from_anywhere(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    receiver = create_receiver(hooks, store=store, publisher=publisher, status_token="s3cret")
    form = {"scope": "shop.charge", "key": "k-1"}
    async with http(receiver) as client:
        assert "class='release'" not in (await client.get("/status")).text
        assert "class='release'" in (await client.get("/status?token=s3cret")).text
        wrong = await client.post("/status/release", data={**form, "token": "guess"})
        assert wrong.status_code == 403
    async with http(receiver, "10.1.2.3") as remote:
        done = await remote.post("/status/release", data={**form, "token": "s3cret"})
        assert done.status_code == 303
    assert await stuck.fetchval("SELECT retryable FROM dedupe_claims") is True
