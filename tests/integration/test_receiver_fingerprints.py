"""Fingerprints at the webhook receiver: a re-serialized retry under "json" is replayed, not
refused; a real conflict is refused with 422 and recorded with its diff, and can be settled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aio_pika
import aio_pika.abc
import asyncpg
import httpx
import pytest

from dedupe import App
from dedupe.claims.store import ClaimStore
from dedupe.effects.outbox import Relay
from dedupe.operations.claims import ClaimAdmin
from dedupe.webhooks import api_key
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_receiver.application import create_receiver

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


async def test_a_webhook_conflict_is_recorded_with_its_diff_and_settled_under_a_new_key(
    channel: str, store: ClaimStore, publisher: RabbitMQPublisher, amqp_url: str
) -> None:
    """422 for the other body, recorded with both fingerprints and the diff; `--run-as`
    publishes it (through the outbox, relayed with confirms) as the request with the new key
    would have been: message id <source>/<tenant>/<new key>."""
    app = hooks_app(channel, keep_payload=True)
    first, other = await post_all(
        app,
        store,
        publisher,
        ("k", b'{"n": 1, "sku": "a"}'),
        ("k", b'{"n": 1, "sku": "b", "gift": true}'),
    )
    assert (first.status_code, other.status_code) == (202, 422)
    scope = "hooks.webhook:orders/tenant-a"
    admin = ClaimAdmin(store)
    shown = await admin.show(scope, "k")
    assert shown is not None
    [conflict] = shown["conflicts"]
    assert conflict["diff"] == ["+ gift (boolean)", "~ sku (string)"]
    assert conflict["fingerprint"].startswith("raw ") and conflict["source"] == "orders"

    settled = await admin.settle_conflict(scope, "k", run_as="k-2")
    assert settled.message_id == "orders/tenant-a/k-2"
    async with Relay(store.pool, publisher) as relay:
        relay.wake()
        message = await message_with(amqp_url, channel, "orders/tenant-a/k-2")
    assert (message.message_id, message.body) == (
        "orders/tenant-a/k-2",
        b'{"n": 1, "sku": "b", "gift": true}',
    )
    forwarded = dict(message.headers or {})
    assert forwarded["x-dedupe-webhook-key"] == "k-2"
    assert forwarded["x-dedupe-webhook-tenant"] == "tenant-a"
    assert "authorization" not in forwarded


async def test_a_webhook_conflict_settled_by_discarding_publishes_nothing(
    channel: str, store: ClaimStore, publisher: RabbitMQPublisher, db: asyncpg.Connection
) -> None:
    """The second body is dropped from the record; nothing goes to the outbox."""
    app = hooks_app(channel, keep_payload=True, fingerprint="json")
    await post_all(app, store, publisher, ("k", b'{"n": 1}'), ("k", b'{"n": 2}'))
    settled = await ClaimAdmin(store).settle_conflict(
        "hooks.webhook:orders/tenant-a", "k", run_as=None
    )
    assert settled.how == "discarded"
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 0
    assert await db.fetchval("SELECT payload FROM dedupe_conflicts") is None


async def message_with(
    url: str, queue_name: str, message_id: str
) -> aio_pika.abc.AbstractIncomingMessage:
    """The message with this id on a queue, taking the ones before it (bounded wait)."""
    connection = await aio_pika.connect(url)
    async with connection:
        amqp = await connection.channel()
        queue = await amqp.declare_queue(queue_name, durable=True, passive=True)
        for _ in range(100):
            message = await queue.get(fail=False)
            if message is None:
                await asyncio.sleep(0.1)
                continue
            await message.ack()
            if message.message_id == message_id:
                return message
    raise AssertionError(f"{message_id} did not arrive on {queue_name} within 10 s")
