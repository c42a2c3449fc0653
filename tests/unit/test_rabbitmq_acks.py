"""The RabbitMQ transport's ack bookkeeping without a broker: runs of done delivery tags go out
as one multiple-ack that never covers a tag still running, requeues are single nacks sent in
order with them, and a closed AMQP channel's tags are forgotten (the broker redelivers them),
so that no channel's map outlives it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiormq.exceptions import ChannelInvalidStateError

from dedupe_rabbitmq.acks import Acks
from dedupe_rabbitmq.transport import RabbitMQTransport


@dataclass(eq=False)  # a dict key by identity, as aiormq's channels are
class Channel:
    """What the bookkeeping asks of an aiormq channel: is it closed, basic.ack, basic.nack."""

    is_closed: bool = False
    frames: list[tuple[str, int, bool]] = field(default_factory=list)  # (method, tag, multiple)

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
        if self.is_closed:
            raise ChannelInvalidStateError("closed")
        self.frames.append(("ack", delivery_tag, multiple))

    async def basic_nack(
        self, delivery_tag: int, multiple: bool = False, requeue: bool = True, wait: bool = True
    ) -> None:
        if self.is_closed:
            raise ChannelInvalidStateError("closed")
        assert requeue
        self.frames.append(("nack", delivery_tag, multiple))


@dataclass
class Frame:
    """The parts of aiormq's DeliveredMessage that the transport's settling reads."""

    channel: Channel
    delivery: Any


@dataclass
class Deliver:
    delivery_tag: int


def delivered(acks: Acks, channel: Channel, count: int) -> list[int]:
    tags = list(range(1, count + 1))
    for tag in tags:
        acks.delivered(channel, tag)
    return tags


def tracked(acks: Acks) -> dict[Any, dict[int, bool]]:
    return {channel: dict(tags.done) for channel, tags in acks._tags.items()}


async def test_an_open_channel_acks_its_done_prefix_in_one_frame() -> None:
    """Tags 1 and 2 done, 3 still running: one basic.ack(2, multiple) and 3 stays tracked."""
    acks, channel = Acks(), Channel()
    delivered(acks, channel, 3)
    assert acks.ack(channel, 1) and acks.ack(channel, 2)
    await acks.drain()
    assert channel.frames == [("ack", 2, True)]
    assert tracked(acks) == {channel: {3: False}}


async def test_a_done_tag_behind_a_running_one_is_never_covered_by_a_multiple_ack() -> None:
    """Tag 1 still running, 2..5 done: nothing goes out in the first flush, then 2..5 one by
    one after LATE_S, and 1 on its own once done; no frame ever acks 1 before it is settled."""
    acks, channel = Acks(), Channel()
    delivered(acks, channel, 5)
    for tag in (2, 3, 4, 5):
        acks.ack(channel, tag)
    await asyncio.sleep(0)  # the flush of this loop iteration
    assert channel.frames == []
    await asyncio.sleep(acks.LATE_S * 4)
    assert channel.frames == [
        ("ack", 2, False),
        ("ack", 3, False),
        ("ack", 4, False),
        ("ack", 5, False),
    ]
    acks.ack(channel, 1)
    await acks.drain()
    assert channel.frames[-1] == ("ack", 1, True)  # nothing above 1 is left unsettled
    assert tracked(acks) == {channel: {}}


async def test_a_requeue_is_a_single_nack_written_before_the_run_passes_over_it() -> None:
    """Tag 2 requeued between done tags 1 and 3: nack(2) alone, then one multiple-ack up to 3."""
    acks, channel = Acks(), Channel()
    delivered(acks, channel, 3)
    acks.ack(channel, 1)
    acks.ack(channel, 3)
    assert acks.requeue(channel, 2)
    await acks.drain()
    assert channel.frames == [("nack", 2, False), ("ack", 3, True)]
    assert tracked(acks) == {channel: {}}


async def test_a_tag_waiting_for_its_requeue_holds_back_the_multiple_ack() -> None:
    """A delivery about to be requeued (its pause before the nack) stays unsettled: the later
    tags' multiple-ack waits for it instead of acking it away."""
    acks, channel = Acks(), Channel()
    delivered(acks, channel, 3)
    acks.ack(channel, 2)
    acks.ack(channel, 3)
    await asyncio.sleep(0)
    assert channel.frames == []  # 1 still pending: no multiple-ack over it
    acks.requeue(channel, 1)
    await acks.drain()
    assert channel.frames == [("nack", 1, False), ("ack", 3, True)]


async def test_an_ack_on_a_closed_channel_raises_and_leaves_no_tags_behind() -> None:
    """The channel died with deliveries in flight: the failed ack drops the channel's whole map."""
    transport, channel = RabbitMQTransport("amqp://unused/"), Channel()
    delivered(transport._acks, channel, 2)
    channel.is_closed = True
    with pytest.raises(ChannelInvalidStateError):
        await transport._ack(Frame(channel, Deliver(1)))  # type: ignore[arg-type]
    assert transport._acks._tags == {}


async def test_an_untracked_delivery_is_acked_and_requeued_directly() -> None:
    """A delivery the consumer never saw (a basic.get's): its own single frames."""
    transport, channel = RabbitMQTransport("amqp://unused/"), Channel()
    await transport._ack(Frame(channel, Deliver(7)))  # type: ignore[arg-type]
    await transport._requeue(Frame(channel, Deliver(8)))  # type: ignore[arg-type]
    assert channel.frames == [("ack", 7, False), ("nack", 8, False)]


async def test_a_closed_channels_done_tags_go_at_the_next_flush_with_the_rest_of_its_map() -> None:
    """Tag 2 done behind a running tag 1 when the channel closes: the flush forgets them both."""
    acks, channel = Acks(), Channel()
    delivered(acks, channel, 2)
    acks.ack(channel, 2)
    channel.is_closed = True
    await acks.drain()
    assert acks._tags == {}
    assert channel.frames == []


async def test_a_delivery_on_a_new_channel_sweeps_away_the_maps_of_closed_ones() -> None:
    """After a reconnect the old channel's running tags are never settled: they still go."""
    acks, old, new = Acks(), Channel(), Channel()
    delivered(acks, old, 2)
    old.is_closed = True
    delivered(acks, new, 1)
    assert tracked(acks) == {new: {1: False}}


async def test_a_dropped_channel_is_forgotten_at_once() -> None:
    """The transport lost its consuming channel: its tags go, and a late ack is not tracked."""
    acks, channel = Acks(), Channel()
    delivered(acks, channel, 2)
    acks.drop(channel)
    assert acks._tags == {}
    assert not acks.ack(channel, 1)
    assert not acks.requeue(channel, 2)


@dataclass(eq=False)
class Wedged(Channel):
    """A channel of a connection whose socket died: aiormq's frame queue is full and its writer
    gone, so a write waits for good (the channel is not marked closed yet)."""

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
        await asyncio.Event().wait()


async def test_a_flush_stuck_on_a_dead_connection_does_not_hold_back_the_new_channels_acks() -> (
    None
):
    """The old channel's flusher waits forever on its write; once the transport drops that
    channel, the new channel's acks still go out, and the shutdown drain does not hang."""
    acks, old, new = Acks(), Wedged(), Channel()
    delivered(acks, old, 1)
    acks.ack(old, 1)
    await asyncio.sleep(0.01)  # the old flusher is now stuck in its write
    acks.drop(old)
    delivered(acks, new, 2)
    acks.ack(new, 1)
    acks.ack(new, 2)
    async with asyncio.timeout(1):
        await acks.drain()
    assert new.frames == [("ack", 2, True)]
