"""The RabbitMQ transport's ack bookkeeping without a broker: runs of done delivery tags go out
as one multiple-ack, and a closed AMQP channel's tags are forgotten (the broker redelivers
them), so that no channel's map outlives it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest

from dedupe_rabbitmq.transport import RabbitMQTransport


@dataclass(eq=False)  # a dict key by identity, as aiormq's channels are
class Channel:
    """The two things the bookkeeping asks of an aiormq channel: is it closed, and basic.ack."""

    is_closed: bool = False
    acked: list[tuple[int, bool]] = field(default_factory=list)

    async def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        if self.is_closed:
            raise aio_pika.exceptions.ChannelInvalidStateError("closed")
        self.acked.append((delivery_tag, multiple))


@dataclass
class Incoming:
    channel: Channel
    delivery_tag: int

    async def ack(self) -> None:
        await self.channel.basic_ack(self.delivery_tag)


def delivered(transport: RabbitMQTransport, channel: Channel, count: int) -> list[Any]:
    deliveries = [Incoming(channel, tag) for tag in range(1, count + 1)]
    for incoming in deliveries:
        transport._acks.delivered(incoming)  # type: ignore[arg-type]
    return deliveries


async def test_an_open_channel_acks_its_done_prefix_in_one_frame() -> None:
    """Tags 1 and 2 done, 3 still running: one basic.ack(2, multiple) and 3 stays tracked."""
    transport, channel = RabbitMQTransport("amqp://unused/"), Channel()
    first, second, _ = delivered(transport, channel, 3)
    await transport._ack(first)
    await transport._ack(second)
    await transport._acks.drain()
    assert channel.acked == [(2, True)]
    assert transport._acks._tags == {channel: {3: False}}


async def test_an_ack_on_a_closed_channel_raises_and_leaves_no_tags_behind() -> None:
    """The channel died with deliveries in flight: the failed ack drops the channel's whole map."""
    transport, channel = RabbitMQTransport("amqp://unused/"), Channel()
    first, _ = delivered(transport, channel, 2)
    channel.is_closed = True
    with pytest.raises(aio_pika.exceptions.ChannelInvalidStateError):
        await transport._ack(first)
    assert transport._acks._tags == {}


async def test_a_closed_channels_done_tags_go_at_the_next_flush_with_the_rest_of_its_map() -> None:
    """Tag 2 done behind a running tag 1 when the channel closes: the flush forgets them both."""
    transport, channel = RabbitMQTransport("amqp://unused/"), Channel()
    _, second = delivered(transport, channel, 2)
    await transport._ack(second)
    channel.is_closed = True
    await transport._acks.drain()
    assert transport._acks._tags == {}
    assert channel.acked == []


async def test_a_delivery_on_a_new_channel_sweeps_away_the_maps_of_closed_ones() -> None:
    """After a reconnect the old channel's running tags are never settled: they still go."""
    transport, old, new = RabbitMQTransport("amqp://unused/"), Channel(), Channel()
    delivered(transport, old, 2)
    old.is_closed = True
    delivered(transport, new, 1)
    assert transport._acks._tags == {new: {1: False}}
