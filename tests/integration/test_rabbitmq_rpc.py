"""Request-reply over RabbitMQ: a request carrying `reply_to` gets the handler's outcome
back, and every duplicate of it gets the stored outcome, without a second run."""

from __future__ import annotations

import json

import aio_pika
from pydantic import BaseModel

from dedupe import App
from dedupe.claims.store import ClaimStore
from dedupe_rabbitmq.topology import declare_channel
from dedupe_rabbitmq.transport import RabbitMQTransport
from tests.conftest import running


class Quote(BaseModel):
    amount_cents: int


async def test_a_request_and_its_duplicate_get_the_same_stored_reply_from_one_run(
    amqp_url: str, channel: str, store: ClaimStore
) -> None:
    runs: list[int] = []
    app = App("t")

    @app.handler(channel, lease_s=3.0)  # a duplicate in flight comes back within 1 s
    async def quote(request: Quote) -> dict[str, int]:
        runs.append(request.amount_cents)
        return {"fee_cents": request.amount_cents // 10, "run": len(runs)}

    connection = await aio_pika.connect(amqp_url)
    async with connection, running(app, store, RabbitMQTransport(amqp_url)):
        amqp = await connection.channel()
        await declare_channel(amqp, channel)  # before publishing: the worker may not have yet
        replies = await amqp.declare_queue(exclusive=True)
        body = json.dumps({"amount_cents": 1234}).encode()
        for correlation in ("first", "again"):  # the caller retried: same message id
            await amqp.default_exchange.publish(
                aio_pika.Message(
                    body,
                    message_id="quote-1",
                    reply_to=replies.name,
                    correlation_id=correlation,
                ),
                routing_key=channel,
            )
        got: dict[str, bytes] = {}
        async with replies.iterator(timeout=25) as messages:
            async for message in messages:
                await message.ack()
                got[message.correlation_id or ""] = message.body
                if len(got) == 2:
                    break
    assert runs == [1234]
    assert set(got) == {"first", "again"}
    # The same JSON value; not the same bytes: jsonb normalises key order and spacing.
    assert json.loads(got["first"]) == json.loads(got["again"]) == {"fee_cents": 123, "run": 1}
