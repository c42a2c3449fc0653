"""An in-memory transport for users' tests: publish, run the real pipeline, inspect outcomes.

The claim store is still PostgreSQL (the guarantees live there); only the broker is replaced.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dedupe.message import Headers, Message
from dedupe.transport import Action, Process, Settlement, Transport

_ids = itertools.count(1)


@dataclass(eq=False)
class MemoryDelivery:
    """A message plus what the core decided about it."""

    message: Message
    settlements: list[Settlement] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    async def settle(self, settlement: Settlement) -> bool:
        self.settlements.append(settlement)
        self.settled.set()
        return True

    @property
    def outcome(self) -> Settlement | None:
        return self.settlements[-1] if self.settlements else None


def make_message(
    channel: str,
    body: bytes | str,
    *,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    attempt: int = 1,
    meta: Mapping[str, Any] | None = None,
) -> Message:
    """Build a Message the way a broker would hand it over."""
    return Message(
        channel=channel,
        body=body.encode() if isinstance(body, str) else body,
        headers=Headers(headers or {}),
        message_id=message_id,
        attempt=attempt,
        content_type="application/json",
        meta=meta or {},
    )


class MemoryTransport(Transport):
    """Queues in a dict; deferred and requeued messages come back after their delay."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[MemoryDelivery]] = {}
        self.dead_letters: dict[str, list[MemoryDelivery]] = {}
        self.acked: dict[str, list[MemoryDelivery]] = {}
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def publish(
        self,
        channel: str,
        body: bytes | str,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> MemoryDelivery:
        delivery = MemoryDelivery(
            make_message(channel, body, message_id=message_id or f"m-{next(_ids)}", headers=headers)
        )
        self._put(delivery)
        return delivery

    def _put(self, delivery: MemoryDelivery) -> None:
        self._pending += 1
        self._idle.clear()
        self.queues.setdefault(delivery.message.channel, asyncio.Queue()).put_nowait(delivery)

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until every published message reached a final outcome (ack or dead letter)."""
        async with asyncio.timeout(timeout_s):
            await self._idle.wait()

    async def serve(self, channels: Sequence[str], process: Process, stop: asyncio.Event) -> None:
        for name in channels:
            self.queues.setdefault(name, asyncio.Queue())
        workers = [asyncio.create_task(self._consume(name, process)) for name in channels]
        await stop.wait()
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    async def _consume(self, name: str, process: Process) -> None:
        queue = self.queues[name]
        running: set[asyncio.Task[None]] = set()
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            task = asyncio.create_task(self._run(name, batch, process))
            running.add(task)
            task.add_done_callback(running.discard)

    async def _run(self, name: str, batch: list[MemoryDelivery], process: Process) -> None:
        await process(name, batch)
        for delivery in batch:
            outcome = delivery.outcome
            assert outcome is not None
            if outcome.action is Action.ACK:
                self.acked.setdefault(name, []).append(delivery)
            elif outcome.action is Action.DEAD_LETTER:
                self.dead_letters.setdefault(name, []).append(delivery)
            else:
                asyncio.get_running_loop().call_later(
                    max(outcome.delay_s, 0.01), self._redeliver, delivery
                )
                continue
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    def _redeliver(self, delivery: MemoryDelivery) -> None:
        message = delivery.message
        again = MemoryDelivery(
            Message(
                channel=message.channel,
                body=message.body,
                headers=message.headers,
                message_id=message.message_id,
                attempt=message.attempt + 1,
                content_type=message.content_type,
                meta=message.meta,
            ),
            settlements=list(delivery.settlements),
        )
        self._pending -= 1
        self._put(again)

    async def close(self) -> None:
        return None
