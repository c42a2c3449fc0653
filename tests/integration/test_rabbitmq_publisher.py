"""The confirming RabbitMQ publisher (the receiver's and the outbox relay's) on a real broker:
hundreds of publishes in flight in a busy event loop are all confirmed within their timeout,
and a channel the broker closed is opened again."""

from __future__ import annotations

import asyncio
import time

import aio_pika

from consumers.rabbitmq_publisher import RabbitMQPublisher


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
    """300 publishes at once beside 20 tasks that keep the loop busy: every one is confirmed
    within its 5 s. Before, one channel carried one publish every few loop turns (aiormq holds
    a channel until the publish is written): about 30 a second here, so the later ones timed
    out; the relay counted them as refused and sent them again later, its backlog growing
    under load."""
    publisher = RabbitMQPublisher(amqp_url, timeout_s=5)
    stop = asyncio.Event()
    busy = [asyncio.create_task(_busy(stop)) for _ in range(20)]
    try:
        await publisher.connect()
        results = await asyncio.gather(
            *(
                publisher.publish(channel, b"{}", message_id=f"m{i}", headers={})
                for i in range(300)
            ),
            return_exceptions=True,
        )
    finally:
        stop.set()
        await asyncio.gather(*busy)
        await publisher.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 300 not confirmed, e.g. {failed[0]!r}"
    assert await _count(amqp_url, channel) == 300


async def test_a_channel_the_broker_closed_is_opened_again(amqp_url: str, channel: str) -> None:
    publisher = RabbitMQPublisher(amqp_url, channels=2)
    try:
        await publisher.publish(channel, b"{}", message_id="a", headers={})
        await publisher._channels[0].close()
        assert await publisher.ready()
        for i in range(4):
            await publisher.publish(channel, b"{}", message_id=f"b{i}", headers={})
    finally:
        await publisher.close()
    assert await _count(amqp_url, channel) == 5
