"""RabbitMQ acknowledgements in runs: one multiple-ack per run of consecutive settled tags."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

logger = logging.getLogger(__name__)


class Acks:
    """Acknowledges settled deliveries with one multiple-ack per run of consecutive tags.

    Settling marks a delivery tag done; once per loop iteration the longest done prefix of each
    AMQP channel's tags goes out as one `basic.ack(multiple=True)`. A done tag stuck behind one
    still running is acked on its own after `LATE_S`, so a slow handler never holds back the
    others' prefetch slots for longer. A lost ack frame means a redelivery, which the claims
    turn into a duplicate: the same as an ack lost on the wire. A closed channel's tags are
    dropped whole: its unacked deliveries go back to their queues on the broker's side and no
    ack for them can be sent any more (after a reconnect, the old channel never comes back).
    """

    LATE_S = 0.05

    def __init__(self) -> None:
        self._tags: dict[Any, dict[int, bool]] = {}  # AMQP channel -> {tag: done}, in order
        self._due = False
        self._late: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def delivered(self, incoming: AbstractIncomingMessage) -> None:
        self._drop_closed()
        if incoming.delivery_tag is not None:
            self._tags.setdefault(incoming.channel, {})[incoming.delivery_tag] = False

    def forget(self, incoming: AbstractIncomingMessage) -> None:
        """The delivery is settled some other way (nack) or cannot be (its channel closed)."""
        self._tags.get(incoming.channel, {}).pop(incoming.delivery_tag or 0, None)
        self._drop_closed()

    def _drop_closed(self) -> None:
        for channel in [channel for channel in self._tags if channel.is_closed]:
            del self._tags[channel]

    def ack(self, incoming: AbstractIncomingMessage) -> bool:
        """Mark the delivery acked; False when it is not tracked (ack it directly)."""
        tags = self._tags.get(incoming.channel)
        if tags is None or incoming.delivery_tag not in tags:
            return False
        tags[incoming.delivery_tag] = True
        self._wake()
        return True

    def _wake(self) -> None:
        self._due = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush(), name="rabbitmq-acks")

    async def _flush(self, *, late: bool = False) -> None:
        while self._due:
            self._due = False
            for channel, tags in list(self._tags.items()):
                if channel.is_closed:
                    self._tags.pop(channel, None)
                    continue
                last = None
                while tags:
                    tag = next(iter(tags))
                    if not tags[tag]:
                        break
                    del tags[tag]
                    last = tag
                single = [tag for tag, done in tags.items() if done] if late else []
                for tag in single:
                    del tags[tag]
                try:
                    if last is not None:
                        await channel.basic_ack(delivery_tag=last, multiple=True)
                    for tag in single:
                        await channel.basic_ack(delivery_tag=tag)
                except Exception as exc:
                    # The channel is gone: the broker delivers these again.
                    logger.warning("could not acknowledge deliveries (%s); they come again", exc)
                if tags and any(tags.values()) and self._late is None:
                    self._late = asyncio.get_running_loop().call_later(self.LATE_S, self._lately)
            late = False

    def _lately(self) -> None:
        self._late = None
        self._due = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush(late=True), name="rabbitmq-acks")
        else:
            self._late = asyncio.get_running_loop().call_later(self.LATE_S, self._lately)

    async def drain(self) -> None:
        if self._late is not None:
            self._late.cancel()
            self._late = None
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._due = True
        await self._flush(late=True)
