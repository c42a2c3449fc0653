"""Natural batching: callers submit one item each; whatever queues up while a flush is in
flight goes out together in the next one. No timers, so no added latency when idle."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    """Coalesce concurrent submissions into calls of `flush(items) -> results`."""

    def __init__(
        self, flush: Callable[[Sequence[T]], Awaitable[Sequence[R]]], *, max_batch: int = 500
    ) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._worker: asyncio.Task[None] | None = None

    def submit_nowait(self, item: T) -> asyncio.Future[R]:
        """Queue an item; its result arrives in the returned future after its flush."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._wake()
        return future

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Submit several items at once; they may share a flush with other callers'."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[R]] = [loop.create_future() for _ in items]
        self._pending.extend(zip(items, futures, strict=True))
        self._wake()
        try:
            return [await future for future in futures]
        except BaseException:
            for future in futures:  # no "exception was never retrieved" for the others
                if future.done() and not future.cancelled():
                    future.exception()
            raise

    def _wake(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name="dedupe-batcher")

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = (
                self._pending[: self._max_batch],
                self._pending[self._max_batch :],
            )
            live = [(item, fut) for item, fut in batch if not fut.done()]
            if not live:
                continue
            try:
                results = await self._flush([item for item, _ in live])
            except Exception as exc:
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
