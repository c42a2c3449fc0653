"""RabbitMQ acknowledgements in runs: one multiple-ack per run of consecutive settled tags."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Protocol

logger = logging.getLogger(__name__)


class AckChannel(Protocol):
    """What the bookkeeping asks of an aiormq channel."""

    @property
    def is_closed(self) -> bool: ...

    def basic_ack(
        self, delivery_tag: int, multiple: bool = False, wait: bool = True
    ) -> Awaitable[None]: ...

    def basic_nack(
        self, delivery_tag: int, multiple: bool = False, requeue: bool = True, wait: bool = True
    ) -> Awaitable[None]: ...


class _Tags:
    """One AMQP channel's unsettled delivery tags, in the order they arrived, and its flusher."""

    __slots__ = ("done", "due", "late", "requeue", "task")

    def __init__(self) -> None:
        self.done: dict[int, bool] = {}  # tag -> acked by the core, oldest first
        self.requeue: list[int] = []  # tags to nack(requeue=True), still in `done` as False
        self.due = False
        self.late: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    def stop(self) -> None:
        if self.late is not None:
            self.late.cancel()
            self.late = None
        if self.task is not None:
            self.task.cancel()


class Acks:
    """Acknowledges settled deliveries with one multiple-ack per run of consecutive tags.

    Settling marks a delivery tag done; once per loop iteration the longest done prefix of each
    AMQP channel's tags goes out as one `basic.ack(multiple=True)`, so a multiple-ack never
    covers a tag that is still running. A done tag stuck behind one still running is acked on
    its own after `LATE_S`, so a slow handler never holds back the others' prefetch slots for
    longer. A requeue is a single `basic.nack`, sent by the same flush: a tag leaves the
    bookkeeping only once its frame is written, so no multiple-ack can take it first. A lost ack
    frame means a redelivery, which the claims turn into a duplicate: the same as an ack lost on
    the wire. A closed channel's tags are dropped whole: its unacked deliveries go back to
    their queues on the broker's side and no ack for them can be sent any more (after a
    reconnect, the old channel never comes back).

    Each channel has a flusher task of its own, cancelled when the channel is dropped: a write
    to a connection whose socket died waits for room in its frame queue for good (aiormq's
    writer is gone, and nothing fails the wait), and it must not hold back the acks of the
    channel that replaced it.
    """

    LATE_S = 0.05
    DRAIN_S = 5.0  # at shutdown, the longest wait for the last frames to be written

    def __init__(self) -> None:
        self._tags: dict[AckChannel, _Tags] = {}

    def delivered(self, channel: AckChannel, tag: int) -> None:
        tags = self._tags.get(channel)
        if tags is None:
            self._drop_closed()
            tags = self._tags[channel] = _Tags()
        tags.done[tag] = False

    def drop(self, channel: AckChannel) -> None:
        """The channel is gone: none of its tags can be settled any more."""
        tags = self._tags.pop(channel, None)
        if tags is not None:
            tags.stop()
        self._drop_closed()

    def _drop_closed(self) -> None:
        for channel in [channel for channel in self._tags if channel.is_closed]:
            self._tags.pop(channel).stop()

    def ack(self, channel: AckChannel, tag: int) -> bool:
        """Mark the delivery acked; False when it is not tracked (ack it directly)."""
        tags = self._tags.get(channel)
        if tags is None or tag not in tags.done:
            return False
        tags.done[tag] = True
        self._wake(channel, tags)
        return True

    def requeue(self, channel: AckChannel, tag: int) -> bool:
        """Have the delivery nacked back to its queue; False when it is not tracked."""
        tags = self._tags.get(channel)
        if tags is None or tags.done.get(tag, True):
            return False
        tags.requeue.append(tag)
        self._wake(channel, tags)
        return True

    def _wake(self, channel: AckChannel, tags: _Tags, *, late: bool = False) -> None:
        tags.due = True
        if tags.task is None or tags.task.done():
            tags.task = asyncio.create_task(
                self._flush(channel, tags, late=late), name="rabbitmq-acks"
            )

    async def _flush(self, channel: AckChannel, tags: _Tags, *, late: bool = False) -> None:
        while tags.due:
            tags.due = False
            if channel.is_closed:
                self._tags.pop(channel, None)
                return
            try:
                await self._settle(channel, tags, late=late)
            except Exception as exc:
                # The channel is gone: the broker delivers these again.
                logger.warning("could not acknowledge deliveries (%s); they come again", exc)
            if any(tags.done.values()) and tags.late is None:
                tags.late = asyncio.get_running_loop().call_later(
                    self.LATE_S, self._lately, channel, tags
                )
            late = False

    @staticmethod
    async def _settle(channel: AckChannel, tags: _Tags, *, late: bool) -> None:
        done = tags.done
        while tags.requeue:
            tag = tags.requeue.pop(0)
            del done[tag]  # written below, before any multiple-ack can pass over it
            await channel.basic_nack(tag, requeue=True, wait=False)
        last = None
        while done:
            tag = next(iter(done))
            if not done[tag]:
                break
            del done[tag]
            last = tag
        single = [tag for tag, acked in done.items() if acked] if late else []
        for tag in single:
            del done[tag]
        if last is not None:
            await channel.basic_ack(last, multiple=True, wait=False)
        for tag in single:
            await channel.basic_ack(tag, wait=False)

    def _lately(self, channel: AckChannel, tags: _Tags) -> None:
        tags.late = None
        if tags.task is None or tags.task.done():
            self._wake(channel, tags, late=True)
        else:  # a flush is writing: look again after it
            tags.due = True
            tags.late = asyncio.get_running_loop().call_later(
                self.LATE_S, self._lately, channel, tags
            )

    async def drain(self) -> None:
        """Write what is settled, stuck tags included, and stop the flushers."""
        try:
            async with asyncio.timeout(self.DRAIN_S):
                for channel, tags in list(self._tags.items()):
                    if tags.late is not None:
                        tags.late.cancel()
                        tags.late = None
                    if tags.task is not None:
                        await asyncio.gather(tags.task, return_exceptions=True)
                    tags.due = True
                    await self._flush(channel, tags, late=True)
        except TimeoutError:
            logger.warning("could not write the last acknowledgements; they come again")
        for tags in self._tags.values():
            tags.stop()
