"""Quorum queues and several nodes per URL, against the real single RabbitMQ node (3.10):
`?queue_type=quorum` makes every queue of a channel a quorum queue on which the worker runs
each key once, dead-letters a poison message after max_attempts, and requeues and defers
(per-message TTL, dead-lettered back) as on classic queues; a classic queue in the way is a
clear error; a URL whose first node is dead connects to the next, and a worker whose node
goes away consumes again through another one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
from collections.abc import Iterator, Sequence

import aio_pika
import asyncpg
import pytest

import dedupe_rabbitmq as rabbitmq
from dedupe import App, Context
from dedupe.claims.store import ClaimStore
from dedupe.errors import ConfigurationError
from dedupe.transport import ACK, Action, Delivery, Settlement, dlq_name
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_rabbitmq.transport import RabbitMQTransport
from tests.conftest import eventually, running
from tests.integration.test_rabbitmq_consumer import Proxy, polled, serving
from tests.integration.test_reconnect import Job, all_effects_once, effect_app, publish_stream


def quorum(amqp_url: str) -> str:
    return f"{amqp_url}?queue_type=quorum"


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections: bound, never listening, and held for the
    test so that no other process takes it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def queue_types(*names: str) -> dict[str, tuple[str, dict[str, object]]]:
    """{queue: (type, {argument: value})} as rabbitmqctl lists them."""
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "name", "type", "arguments", "--formatter", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return {
        row["name"]: (row["type"], {name: value for name, _, value in row["arguments"]})
        for row in json.loads(listed.stdout)
        if row["name"] in names
    }


async def test_a_worker_on_quorum_queues_runs_each_key_once(
    amqp_url: str, channel: str, db_url: str, db: asyncpg.Connection
) -> None:
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    url = quorum(amqp_url)
    await publish_stream(url, channel, 40)
    await publish_stream(url, channel, 40)  # every key twice
    async with (
        ClaimStore.open(db_url, owner="w", max_size=5) as store,
        running(effect_app(channel), store, RabbitMQTransport(url)),
    ):
        await all_effects_once(db, 40)
    names = [channel, dlq_name(channel), *rabbitmq.delay_queues(channel)]
    types = queue_types(*names)
    assert set(types) == set(names)
    for name, (kind, arguments) in types.items():
        assert kind == "quorum", (name, arguments)
        assert arguments["x-delivery-limit"] == 100_000, (name, arguments)


async def test_a_poison_message_reaches_the_quorum_dlq_after_max_attempts(
    amqp_url: str, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    app = App("t")
    runs: list[int] = []

    @app.handler(channel, max_attempts=3, backoff_s=0.01, max_backoff_s=0.02)
    async def work(payload: Job, ctx: Context) -> None:
        runs.append(ctx.attempt)
        raise ConnectionError("the downstream service is down")

    url = quorum(amqp_url)
    await rabbitmq.publish(url, channel, [(b'{"n": 1}', {}, "poison")])
    async with running(app, store, RabbitMQTransport(url)):

        async def dead() -> list[dict[str, object]]:
            return await rabbitmq.peek_dead_letters(url, channel, limit=5)

        [letter] = await eventually(dead, timeout_s=20)
    assert runs == [1, 2, 3]
    assert letter["message_id"] == "poison" and letter["reason"] == "max_attempts_exceeded"
    assert await db.fetchval("SELECT status FROM dedupe_claims WHERE key = 'poison'") == "failed"
    assert queue_types(dlq_name(channel))[dlq_name(channel)][0] == "quorum"


async def test_requeue_and_a_deferral_through_a_quorum_delay_queue_come_back(
    amqp_url: str, channel: str
) -> None:
    """nack-requeue, then a copy that waits out its per-message TTL in <channel>.delay.5s and
    is dead-lettered back to the work queue: the transport's paths, on quorum queues."""
    settled: list[str] = []

    async def settle(delivery: Delivery) -> None:
        step = len(settled)
        if step == 0:
            settled.append("requeue")
            await delivery.settle(Settlement(Action.REQUEUE, detail="stopping"))
        elif step == 1:
            settled.append("defer")
            await delivery.settle(Settlement(Action.DEFER, delay_s=0.3, detail="later"))
        else:
            settled.append("ack")
            await delivery.settle(ACK)

    url = quorum(amqp_url)
    await rabbitmq.publish(url, channel, [(b"{}", {}, "m-1")])
    transport = RabbitMQTransport(url)
    async with serving(transport, channel, settle) as seen:
        await eventually(polled(lambda: len(seen) == 3), timeout_s=15)
        await asyncio.sleep(0.3)
    assert settled == ["requeue", "defer", "ack"]
    assert [m.message_id for m in seen] == ["m-1"] * 3
    assert [m.meta["redelivered"] for m in seen] == [False, True, False]
    assert [m.attempt for m in seen] == [1, 1, 2]  # the deferral counts, the requeue does not
    delay = rabbitmq.delay_name(channel, 0.3)
    assert queue_types(delay)[delay][0] == "quorum"


async def test_a_classic_queue_in_the_way_is_an_error_that_says_what_to_do(
    amqp_url: str, channel: str
) -> None:
    await rabbitmq.publish(amqp_url, channel, [(b"{}", {}, "m-1")])  # classic, as before
    stop = asyncio.Event()

    async def process(name: str, deliveries: Sequence[Delivery]) -> None:
        raise AssertionError("nothing is consumed")

    transport = RabbitMQTransport(quorum(amqp_url))
    try:
        with pytest.raises(ConfigurationError) as caught:
            await asyncio.wait_for(transport.serve([channel], process, stop), 15)
    finally:
        await transport.close()
    text = str(caught.value)
    assert "exists as a classic queue" in text and "queue_type=classic" in text
    assert "delete_queue" in text and f"{channel}.delay.5s" in text and f"{channel}.dlq" in text
    with pytest.raises(ConfigurationError, match="queue_type=classic"):
        await rabbitmq.publish(quorum(amqp_url), channel, [(b"{}", {}, "m-2")])


async def test_a_url_whose_first_node_is_dead_connects_to_the_next(
    amqp_url: str, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    live = amqp_url.split("@", 1)[1].split("/", 1)[0]
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    with closed_port() as dead_port:
        url = f"amqp://guest:guest@127.0.0.1:{dead_port},{live}/?queue_type=quorum"
        await publish_stream(url, channel, 10)  # the admin functions
        publisher = RabbitMQPublisher(url)  # the outbox relay's and the receiver's
        try:
            await publisher.publish(channel, b'{"n": 10}', message_id="k10", headers={})
        finally:
            await publisher.close()
        async with running(effect_app(channel), store, RabbitMQTransport(url)):
            await all_effects_once(db, 11)
        assert await rabbitmq.peek_dead_letters(url, channel, limit=5) == []


async def test_a_worker_whose_node_goes_away_consumes_through_the_next_one(
    amqp_url: str, channel: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Two relays stand for two nodes: the first stops accepting and cuts its connections (the
    node died); the transport reconnects through the second and the stream finishes once."""
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    async with Proxy() as first, Proxy() as second:
        nodes = ",".join(p.url.split("@", 1)[1].rstrip("/") for p in (first, second))
        url = f"amqp://guest:guest@{nodes}/?queue_type=quorum"
        await publish_stream(amqp_url + "?queue_type=quorum", channel, 200)
        transport = RabbitMQTransport(url)
        async with running(effect_app(channel), store, transport):

            async def some() -> bool:
                return bool(await db.fetchval("SELECT count(*) >= 20 FROM effects"))

            await eventually(some, timeout_s=20)
            assert (first.connections, second.connections) == (1, 0)
            first.accepting = False
            first.cut()
            await all_effects_once(db, 200)
            assert second.connections == 1 and transport.reconnects == 1
        # Messages published through the multi-node URL after the loss reach the workers too.
        await publish_stream(url, channel, 1)

    async def left() -> int:
        connection = await aio_pika.connect(amqp_url, timeout=10)
        async with connection:
            amqp = await connection.channel()
            queue = await amqp.declare_queue(channel, passive=True)
            return int(queue.declaration_result.message_count or 0)

    assert await left() == 1
