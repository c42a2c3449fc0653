"""Request-reply over Kafka: a record naming a reply topic in its `reply-to` header gets the
handler's outcome there with its `correlation-id`, and every duplicate of it gets the stored
outcome, without a second run; the offset is committed only once the reply is on the broker."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer
from pydantic import BaseModel

import dedupe_kafka as kafka
from dedupe import App
from dedupe.claims.store import ClaimStore
from tests.conftest import delete_channel_everywhere, eventually, running
from tests.integration.brokers import KafkaBroker

# The headers' names are the contract (docs/design.md, Kafka), so they are spelled out here.
REPLY_TO_HEADER = "reply-to"
CORRELATION_ID_HEADER = "correlation-id"


class Quote(BaseModel):
    amount_cents: int


@pytest.fixture
async def replies(request: pytest.FixtureRequest, channel: str) -> AsyncIterator[str]:
    """The caller's reply topic (the caller creates it; the worker never does)."""
    name = f"{channel}-replies"
    yield name
    await delete_channel_everywhere(request, name)


async def read(url: str, topic: str, count: int) -> list[tuple[bytes | None, dict[str, bytes]]]:
    """The first `count` records of a topic: (value, headers)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka.KafkaOptions.from_url(url).bootstrap_servers,
        group_id=f"reader-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    got: list[tuple[bytes | None, dict[str, bytes]]] = []
    try:

        async def enough() -> bool:
            batches = await consumer.getmany(timeout_ms=200)
            got.extend((r.value, dict(r.headers)) for rs in batches.values() for r in rs)
            return len(got) >= count

        await eventually(enough, timeout_s=30)
    finally:
        await consumer.stop()
    return got


async def test_a_request_and_its_duplicate_get_the_same_stored_reply_from_one_run(
    kafka_url: str, channel: str, replies: str, store: ClaimStore
) -> None:
    """Two records of one message id, each with its own correlation id: one run, two replies
    on the reply topic carrying the same stored result; the group commits past both."""
    broker = KafkaBroker(kafka_url, partitions=1)
    runs: list[int] = []
    app = App("t")

    @app.handler(channel, lease_s=3.0)
    async def quote(request: Quote) -> dict[str, int]:
        runs.append(request.amount_cents)
        return {"fee_cents": request.amount_cents // 10, "run": len(runs)}

    await kafka.ensure_topics(kafka.KafkaOptions.from_url(kafka_url), [replies])
    body = json.dumps({"amount_cents": 1234}).encode()
    await broker.publish(
        channel,
        [
            (body, {REPLY_TO_HEADER: replies, CORRELATION_ID_HEADER: correlation}, "quote-1")
            for correlation in ("first", "again")  # the caller retried: same message id
        ],
    )
    async with running(app, store, broker.transport()) as worker:
        got = await read(kafka_url, replies, 2)

        async def committed() -> bool:
            return await broker.backlog(channel) == 0

        await eventually(committed, timeout_s=30)
        assert worker.stats.duplicates == 1
    assert runs == [1234]
    by_correlation = {headers[CORRELATION_ID_HEADER].decode(): value for value, headers in got}
    assert set(by_correlation) == {"first", "again"}
    # The same JSON value (jsonb normalises key order and spacing, as on RabbitMQ).
    first, again = (json.loads(by_correlation[c] or b"null") for c in ("first", "again"))
    assert first == again == {"fee_cents": 123, "run": 1}
    assert all(headers["content-type"] == b"application/json" for _, headers in got)


async def test_a_reply_to_that_is_no_topic_name_is_logged_and_the_request_still_done(
    kafka_url: str, channel: str, store: ClaimStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A reply topic Kafka can never hold (a space in its name) cannot be answered: the
    outcome is recorded, a warning says so, and the offset moves on (nothing stalls)."""
    broker = KafkaBroker(kafka_url, partitions=1)
    app = App("t")

    @app.handler(channel)
    async def quote(request: Quote) -> int:
        return request.amount_cents

    await broker.publish(
        channel, [(json.dumps({"amount_cents": 5}).encode(), {REPLY_TO_HEADER: "no way"}, "q-2")]
    )
    async with running(app, store, broker.transport()) as worker:

        async def done() -> bool:
            return worker.stats.completed == 1 and await broker.backlog(channel) == 0

        await eventually(done, timeout_s=30)
    assert "cannot reply" in caplog.text
