"""RabbitMQ's delay buckets: a deferral waits in the smallest bucket that covers its delay, so a
short delay never waits behind a long one (RabbitMQ expires messages only at a queue's head:
with the single `C.delay` of before, a 1 s deferral behind a 1 h one waited the hour)."""

from __future__ import annotations

from dedupe.transport import Action, Settlement
from dedupe_rabbitmq.topology import delay_name, delay_queues
from tests.conftest import eventually
from tests.integration.test_rabbitmq_unroutable import body, fetched, queued


def test_a_delay_waits_in_the_smallest_bucket_that_covers_it() -> None:
    assert delay_name("c", 0.05) == "c.delay.5s"
    assert delay_name("c", 6) == "c.delay.30s"
    assert delay_name("c", 600) == "c.delay.10m"
    assert delay_name("c", 7200) == "c.delay.1h"
    assert delay_queues("c")[-1] == "c.delay"  # the earlier versions' queue, still declared


async def test_a_short_deferral_is_not_held_behind_a_long_one(amqp_url: str, channel: str) -> None:
    messages = [(body(1), "long", {}), (body(2), "short", {})]
    async with fetched(amqp_url, channel, *messages) as (amqp, (long, short)):
        assert await long.settle(Settlement(Action.DEFER, delay_s=3600, detail="later"))
        assert await short.settle(Settlement(Action.DEFER, delay_s=0.5, detail="soon"))

        async def back() -> bool:
            return await queued(amqp_url, channel) == 1

        await eventually(back, timeout_s=10)
        frame = await amqp.basic_get(channel, no_ack=True, timeout=5)
        assert frame.header.properties.message_id == "short"
        assert await queued(amqp_url, delay_name(channel, 3600)) == 1
