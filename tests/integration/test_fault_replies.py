"""Fault replies (DESIGN §4.7): a request that ends dead-lettered, failed, conflicting or
invalid gets a reply that says so (`x-dedupe-status`, `x-dedupe-reason`, a small JSON body) on
RabbitMQ's `reply_to` and on Kafka's reply topic, and its duplicates get the same reply again.
Before, only a stored result was replied: a caller of a failed request timed out."""

from __future__ import annotations

import json
from typing import Any

import aio_pika
from pydantic import BaseModel

import dedupe_kafka as kafka
from dedupe import App, Reject
from dedupe.claims.store import ClaimStore
from dedupe_rabbitmq.topology import declare_channel
from dedupe_rabbitmq.transport import RabbitMQTransport
from tests.conftest import running
from tests.integration.brokers import KafkaBroker
from tests.integration.test_kafka_rpc import CORRELATION_ID_HEADER, REPLY_TO_HEADER, read, replies

__all__ = ["replies"]  # the Kafka reply topic's fixture


class Quote(BaseModel):
    amount_cents: int


def quote_app(channel: str, runs: list[int]) -> App:
    app = App("t")

    @app.handler(channel, lease_s=3.0, max_attempts=1)
    async def quote(request: Quote) -> dict[str, int]:
        runs.append(request.amount_cents)
        if request.amount_cents < 0:
            raise Reject("a negative amount")
        return {"fee_cents": request.amount_cents // 10}

    return app


def body(amount: int) -> bytes:
    return json.dumps({"amount_cents": amount}).encode()


# (message id, body, correlation id), in publish order, and what each reply must say.
REQUESTS = [
    ("p-1", body(-1), "poison"),
    ("p-1", body(-1), "poison-again"),  # the caller retried: a duplicate of a failed key
    ("c-1", body(50), "first"),
    ("c-1", body(60), "conflicting"),  # the same key with another payload
    ("i-1", b"not json", "invalid"),
]
FAULTS = {
    "poison": ("failed", "rejected"),
    "poison-again": ("failed", "rejected"),
    "conflicting": ("conflict", "key_conflict"),
    "invalid": ("invalid", "invalid_payload"),
}


def check(replies: dict[str, tuple[bytes, dict[str, Any]]]) -> None:
    assert set(replies) == {correlation for _, _, correlation in REQUESTS}
    value, headers = replies["first"]
    assert json.loads(value) == {"fee_cents": 5}
    assert "x-dedupe-status" not in headers  # a result's reply is as it was
    for correlation, (status, reason) in FAULTS.items():
        value, headers = replies[correlation]
        said = json.loads(value)
        assert (headers["x-dedupe-status"], headers["x-dedupe-reason"]) == (status, reason)
        assert (said["status"], said["reason"]) == (status, reason), correlation
        assert isinstance(said["detail"], str)
    assert json.loads(replies["poison"][0]) == json.loads(replies["poison-again"][0])
    assert "a negative amount" in json.loads(replies["poison"][0])["detail"]


async def test_rabbitmq_requests_that_fail_conflict_or_are_invalid_get_a_fault_reply(
    amqp_url: str, channel: str, store: ClaimStore
) -> None:
    runs: list[int] = []
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        await declare_channel(amqp, channel)
        reply_queue = await amqp.declare_queue(exclusive=True)
        # Published one at a time, each after the last reply: the order is the story.
        got: dict[str, tuple[bytes, dict[str, Any]]] = {}
        async with (
            running(quote_app(channel, runs), store, RabbitMQTransport(amqp_url)),
            reply_queue.iterator(timeout=25) as messages,
        ):
            for message_id, payload, correlation in REQUESTS:
                await amqp.default_exchange.publish(
                    aio_pika.Message(
                        payload,
                        message_id=message_id,
                        reply_to=reply_queue.name,
                        correlation_id=correlation,
                    ),
                    routing_key=channel,
                )
                async for message in messages:
                    await message.ack()
                    headers = {k: str(v) for k, v in (message.headers or {}).items()}
                    got[message.correlation_id or ""] = (message.body, headers)
                    break
    check(got)
    assert runs == [-1, 50]  # the duplicate, the conflict and the invalid body never ran


async def test_kafka_requests_that_fail_conflict_or_are_invalid_get_a_fault_reply(
    kafka_url: str, channel: str, replies: str, store: ClaimStore
) -> None:
    broker = KafkaBroker(kafka_url, partitions=1)
    runs: list[int] = []
    await kafka.ensure_topics(kafka.KafkaOptions.from_url(kafka_url), [replies])
    await broker.publish(
        channel,
        [
            (payload, {REPLY_TO_HEADER: replies, CORRELATION_ID_HEADER: correlation}, message_id)
            for message_id, payload, correlation in REQUESTS
        ],
    )
    async with running(quote_app(channel, runs), store, broker.transport()):
        records = await read(kafka_url, replies, len(REQUESTS))
    got = {
        headers[CORRELATION_ID_HEADER].decode(): (
            value or b"",
            {k: v.decode() for k, v in headers.items()},
        )
        for value, headers in records
    }
    check(got)
    assert runs == [-1, 50]
