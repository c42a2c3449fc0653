"""Natural batching: callers submit items; whatever queues up while a flush is in flight goes out
together in the next one. No timers, so no added latency when idle."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Group(Generic[T, R]):
    """One caller's items and the future of their results (one future per caller, not per item)."""

    __slots__ = ("future", "items", "results", "taken")

    def __init__(self, items: Sequence[T], future: asyncio.Future[list[R]]) -> None:
        self.items = items
        self.future = future
        self.results: list[R] = []
        self.taken = 0  # items already in a flush (a group larger than max_batch is split)


class Batcher(Generic[T, R]):
    """Coalesce concurrent submissions into calls of `flush(items) -> results`."""

    def __init__(
        self, flush: Callable[[Sequence[T]], Awaitable[Sequence[R]]], *, max_batch: int = 500
    ) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._pending: list[_Group[T, R]] = []
        self._worker: asyncio.Task[None] | None = None

    def submit_nowait(self, item: T) -> asyncio.Future[list[R]]:
        """Queue one item; its result arrives in the returned future (a one-item list)."""
        future: asyncio.Future[list[R]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Group((item,), future))
        self._wake()
        return future

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Submit several items at once; they may share a flush with other callers'."""
        future: asyncio.Future[list[R]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Group(items, future))
        self._wake()
        return await future

    def _wake(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name="dedupe-batcher")

    async def _drain(self) -> None:
        while self._pending:
            batch: list[tuple[_Group[T, R], int]] = []  # (group, how many of its items)
            items: list[T] = []
            while self._pending and len(items) < self._max_batch:
                group = self._pending[0]
                if group.future.done():  # cancelled by its caller
                    self._pending.pop(0)
                    continue
                room = self._max_batch - len(items)
                part = group.items[group.taken : group.taken + room]
                items.extend(part)
                batch.append((group, len(part)))
                group.taken += len(part)
                if group.taken >= len(group.items):
                    self._pending.pop(0)
            if not items:
                continue
            try:
                results = await self._flush(items)
            except Exception as exc:
                for group, _ in batch:
                    if not group.future.done():
                        group.future.set_exception(exc)
                continue
            at = 0
            for group, count in batch:
                group.results.extend(results[at : at + count])
                at += count
                if len(group.results) >= len(group.items) and not group.future.done():
                    group.future.set_result(group.results)
