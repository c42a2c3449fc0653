"""The confirming RabbitMQ publisher (the receiver's and the outbox relay's) on a real broker:
hundreds of publishes in flight in a busy event loop are all confirmed within their timeout,
each channel's queues are declared once, and a channel the broker closed is replaced."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aio_pika
import pytest

from dedupe.errors import DedupeError
from dedupe_rabbitmq.publisher import RabbitMQPublisher


async def _busy(stop: asyncio.Event) -> None:
    """A task that holds the event loop 0.5 ms at each turn, as handlers beside a relay do."""
    while not stop.is_set():
        began = time.perf_counter()
        while time.perf_counter() - began < 0.0005:
            pass
        await asyncio.sleep(0)


async def _count(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        declared = await amqp.declare_queue(queue, durable=True, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def test_hundreds_in_flight_in_a_busy_loop_are_all_confirmed(
    amqp_url: str, channel: str
) -> None:
    """600 publishes at once beside 20 tasks that keep the loop busy: every one is confirmed
    within its 10 s (about 3 s here). Before, one channel carried one publish every few loop
    turns (aiormq holds a channel until the publish is written): about 30 a second here, so
    the later ones timed out; the relay counted them as refused and sent them again later,
    its backlog growing under load."""
    publisher = RabbitMQPublisher(amqp_url, timeout_s=10)
    stop = asyncio.Event()
    busy = [asyncio.create_task(_busy(stop)) for _ in range(20)]
    try:
        await publisher.connect()
        results = await asyncio.gather(
            *(
                publisher.publish(channel, b"{}", message_id=f"m{i}", headers={})
                for i in range(600)
            ),
            return_exceptions=True,
        )
    finally:
        stop.set()
        await asyncio.gather(*busy)
        await publisher.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 600 not confirmed, e.g. {failed[0]!r}"
    assert await _count(amqp_url, channel) == 600


async def test_concurrent_publishes_to_a_new_channel_declare_its_queues_once(
    amqp_url: str, channel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, each of them declared the queues (three round trips each, holding the channel),
    and the later publishes waited for those declares past their timeout."""
    from dedupe_rabbitmq import publisher as rabbitmq_publisher

    declares: list[str] = []
    declare = rabbitmq_publisher.declare_channel

    async def counting(amqp: Any, name: str, **options: Any) -> Any:
        declares.append(name)
        return await declare(amqp, name, **options)

    monkeypatch.setattr(rabbitmq_publisher, "declare_channel", counting)
    publisher = RabbitMQPublisher(amqp_url)
    try:
        await asyncio.gather(
            *(publisher.publish(channel, b"{}", message_id=f"m{i}", headers={}) for i in range(50))
        )
    finally:
        await publisher.close()
    assert declares == [channel]


def _open_channels(publisher: RabbitMQPublisher) -> int:
    connection = publisher._connection
    assert connection is not None and connection.transport is not None
    channels = connection.transport.connection.channels.values()
    return sum(1 for c in channels if c is not None and not c.is_closed)


async def test_a_channel_the_broker_closed_is_replaced_not_doubled(
    amqp_url: str, channel: str
) -> None:
    """A channel the broker closes (here a 406 on a declare) is replaced and closed for good:
    before, aio-pika reopened it beside its replacement, one channel more each time."""
    publisher = RabbitMQPublisher(amqp_url, channels=2)
    try:
        await publisher.publish(channel, b"{}", message_id="a", headers={})
        first = publisher._channels[0]
        assert first is not None
        with pytest.raises(aio_pika.exceptions.ChannelPreconditionFailed):
            await first.declare_queue(channel, durable=False)  # 406: the broker closes it
        await asyncio.sleep(0.01)  # a robust channel would be reopening by now
        for i in range(10):
            await publisher.publish(channel, b"{}", message_id=f"b{i}", headers={})
        await asyncio.sleep(1.5)  # time for a reopen in the background, if one were coming
        assert _open_channels(publisher) == 2
        assert await publisher.ready()
    finally:
        await publisher.close()
    assert await _count(amqp_url, channel) == 11


async def test_publishes_waiting_for_a_connect_that_fails_fail_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker that cannot be reached: the publishes waiting behind the failing connect
    attempt fail with it (before, each made its own attempt in turn, one timeout each)."""
    from dedupe_rabbitmq import publisher as rabbitmq_publisher

    attempts = 0

    async def unreachable(url: str, **options: Any) -> Any:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0.2)
        raise ConnectionError("unreachable (simulated)")

    monkeypatch.setattr(rabbitmq_publisher.aio_pika, "connect", unreachable)
    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:5672/")
    results = await asyncio.gather(
        *(publisher.publish("c", b"{}", message_id=f"m{i}", headers={}) for i in range(20)),
        return_exceptions=True,
    )
    assert all(isinstance(r, DedupeError) and "cannot connect" in str(r) for r in results)
    assert attempts == 1
    with pytest.raises(DedupeError):  # a later publish tries again
        await publisher.publish("c", b"{}", message_id="later", headers={})
    assert attempts == 2
