"""Fingerprints at the webhook receiver: a re-serialized retry under "json" is replayed, not
refused; a real conflict is refused with 422 and recorded with its diff, and can be settled."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from consumers.rabbitmq import RabbitMQPublisher
from consumers.receiver import create_receiver
from dedupe import App
from dedupe.store import ClaimStore
from dedupe.webhooks import api_key

API_KEY = "api-key-fp-4d1c"


def orders(key: str) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {API_KEY}",
        "Idempotency-Key": key,
    }


def hooks_app(channel: str, **options: object) -> App:
    app = App("hooks")
    app.webhook(
        "orders",
        verify=api_key({API_KEY: "tenant-a"}),
        key="header:Idempotency-Key",
        channel=channel,
        **options,  # type: ignore[arg-type]
    )
    return app


@pytest.fixture
async def publisher(amqp_url: str) -> AsyncIterator[RabbitMQPublisher]:
    publisher = RabbitMQPublisher(amqp_url)
    yield publisher
    await publisher.close()


async def post_all(
    app: App, store: ClaimStore, publisher: RabbitMQPublisher, *requests: tuple[str, bytes]
) -> list[httpx.Response]:
    """POST each (key, body) in turn to a receiver whose lifespan runs (its activity too)."""
    receiver = create_receiver(app, store=store, publisher=publisher)
    responses = []
    async with receiver.router.lifespan_context(receiver):
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as http:
            for key, body in requests:
                responses.append(
                    await http.post("/webhooks/orders", content=body, headers=orders(key))
                )
    return responses


async def test_a_reserialized_webhook_retry_is_replayed_under_json(
    channel: str, store: ClaimStore, publisher: RabbitMQPublisher
) -> None:
    """The sender's retry with other key order and spacing gets the stored 202 again."""
    app = hooks_app(channel, fingerprint="json", fingerprint_exclude=("sent_at",))
    first, retry, other = await post_all(
        app,
        store,
        publisher,
        ("k", b'{"n": 1, "sku": "a", "sent_at": "10:00"}'),
        ("k", b'{"sku":"a","n":1,"sent_at":"10:01"}'),
        ("k", b'{"sku":"a","n":2}'),
    )
    assert first.status_code == 202, first.text
    assert (retry.status_code, retry.content) == (202, first.content)
    assert retry.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
