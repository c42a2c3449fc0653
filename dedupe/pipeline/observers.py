"""What the pipeline tells observers (metrics, tracing, the outcome log, the status page).

Observers are called inline, so every method must be cheap and must not block: anything
that needs I/O is buffered and done by the observer's own background task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Self

from dedupe.claims.records import Reason
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.transport import Action, Settlement

logger = logging.getLogger("dedupe.outcome")
_flush_logger = logging.getLogger(__name__)


def outcome_of(settlement: Settlement) -> str:
    """One word for what happened to a message under one handler."""
    if settlement.action is Action.ACK:
        return "duplicate" if settlement.duplicate else "completed"
    if settlement.action is Action.DEAD_LETTER:
        return "conflict" if settlement.reason is Reason.KEY_CONFLICT else "dead_lettered"
    if settlement.action is Action.DEFER:
        return "deferred"
    return "requeued"


class Observer:
    """Does nothing; subclasses override what they watch."""

    def claimed(self, handler: str, seconds: float, count: int) -> None:
        """A claim statement for `count` keys of `handler` took `seconds`."""

    def ran(self, handler: str, seconds: float, *, ok: bool) -> None:
        """One run of `handler` (one attempt) took `seconds`."""

    def concluded(
        self,
        handler: str,
        scope: str,
        key: str,
        message: Message,
        settlement: Settlement,
        started: float,
    ) -> None:
        """The pipeline decided `settlement` for this message under `handler`.

        `started` is the loop time (time.perf_counter) at which the batch began.
        """


class Observers(Observer):
    """Several observers called in turn; one that raises is logged and skipped."""

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self.members = [OutcomeLog(), *observers]

    def claimed(self, handler: str, seconds: float, count: int) -> None:
        for member in self.members:
            try:
                member.claimed(handler, seconds, count)
            except Exception:
                logger.exception("observer %r failed", member)

    def ran(self, handler: str, seconds: float, *, ok: bool) -> None:
        for member in self.members:
            try:
                member.ran(handler, seconds, ok=ok)
            except Exception:
                logger.exception("observer %r failed", member)

    def concluded(
        self,
        handler: str,
        scope: str,
        key: str,
        message: Message,
        settlement: Settlement,
        started: float,
    ) -> None:
        for member in self.members:
            try:
                member.concluded(handler, scope, key, message, settlement, started)
            except Exception:
                logger.exception("observer %r failed", member)


class OutcomeLog(Observer):
    """One line per message and handler: DEBUG for the usual, WARNING for dead letters."""

    def concluded(
        self,
        handler: str,
        scope: str,
        key: str,
        message: Message,
        settlement: Settlement,
        started: float,
    ) -> None:
        level = logging.WARNING if settlement.action is Action.DEAD_LETTER else logging.DEBUG
        if not logger.isEnabledFor(level):
            return
        outcome = outcome_of(settlement)
        logger.log(
            level,
            "%s %s/%s: %s%s",
            handler,
            scope,
            key,
            outcome,
            f" ({settlement.reason}: {settlement.detail})" if settlement.reason else "",
            extra={
                "handler": handler,
                "scope": scope,
                "key": key,
                "message_id": message.message_id,
                "attempt": message.attempt,
                "outcome": outcome,
                "reason": str(settlement.reason) if settlement.reason else None,
            },
        )


class FlushingObserver(Observer):
    """An observer that buffers and writes in the background: `flush()` every `interval_s`,
    and once more when it stops. Use it as an async context manager."""

    task_name = "dedupe-flush"
    interval_s: float = 5.0
    stop_timeout_s: float = 10.0
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event | None = None

    async def flush(self) -> None:
        """Write what was buffered; raise StoreError when the database refuses."""
        raise NotImplementedError

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()
            try:
                await self.flush()
            except StoreError as exc:
                _flush_logger.warning("%s", exc)

    async def __aenter__(self) -> Self:
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._loop(self._stop), name=self.task_name)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """The loop's last flush, after the stop; a flush under way is not cut short (a
        cancelled one lost what it had taken, such as a duplicate's trace), unless it takes
        longer than `stop_timeout_s`."""
        task, self._task = self._task, None
        if task is None:
            return
        assert self._stop is not None
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), self.stop_timeout_s)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        except asyncio.CancelledError:
            task.cancel()
            raise


__all__ = ["FlushingObserver", "Observer", "Observers", "OutcomeLog", "outcome_of"]
