"""A real `dedupe-worker` on RabbitMQ, SIGKILLed the moment its conflict's dead letter
arrives: the conflict's record is in the table all the same (written before the dead letter,
not buffered for a later flush)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable

import aio_pika
import asyncpg

import dedupe_rabbitmq as rabbitmq
from dedupe.transport import dlq_name
from tests.acceptance.conftest import Spawner, payload, wait_exit
from tests.conftest import eventually


async def test_a_worker_killed_right_after_a_conflicts_dead_letter_leaves_its_record(
    spawner: Spawner, amqp_url: str, channel: str, effects: asyncpg.Connection
) -> None:
    """Key k runs with n=1; another payload under k is dead-lettered as key_conflict; the
    worker is SIGKILLed as soon as the dead letter reaches its queue (a consumer on the
    dead-letter queue does it, within a millisecond or so): its record counts the delivery."""
    start: Callable[..., subprocess.Popen[bytes]] = spawner.start
    worker = start(amqp_url)
    await rabbitmq.publish(amqp_url, channel, [(payload(1), {}, "k")])

    async def ran() -> bool:
        return bool(await effects.fetchval("SELECT count(*) = 1 FROM effects"))

    await eventually(ran, timeout_s=30)
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        dlq = await amqp.declare_queue(dlq_name(channel), durable=True, passive=True)
        arrived: asyncio.Future[aio_pika.abc.AbstractIncomingMessage] = (
            asyncio.get_running_loop().create_future()
        )

        async def on_dead_letter(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            worker.send_signal(signal.SIGKILL)  # first, before anything else can happen
            if not arrived.done():
                arrived.set_result(message)

        await dlq.consume(on_dead_letter)
        await rabbitmq.publish(amqp_url, channel, [(payload(2), {}, "k")])
        letter = await asyncio.wait_for(arrived, timeout=30)
        assert await wait_exit(worker) == -signal.SIGKILL
        assert (letter.headers or {})["x-dedupe-reason"] == "key_conflict"
    rows = await effects.fetch("SELECT scope, key, deliveries, message_id FROM dedupe_conflicts")
    assert [(r["scope"], r["key"], r["deliveries"], r["message_id"]) for r in rows] == [
        ("crashy.work", "k", 1, "k")
    ]
