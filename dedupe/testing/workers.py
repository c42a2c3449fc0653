"""A simulated worker process for dedupe.testing: its own pool, claim store and Processor on the
run's database, consuming from the in-memory broker; it can die at once or freeze, as a real
process does.

Dying is faithful to a killed process: the broker takes its unsettled deliveries back, its
database connections drop (the server rolls back their open transactions) and its runs are
cancelled, so nothing after that moment happens: no give-back, no completion, no ack. Its
claims stay as it left them. Freezing (a stopped process, a long pause) holds its heartbeats,
so its leases lapse while it is frozen.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Sequence
from typing import Literal

import asyncpg

from dedupe.app import App
from dedupe.claims.database import connect_pool
from dedupe.claims.records import Fence, KeyId
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.pipeline.stats import Stats
from dedupe.testing.memory import MemoryBroker, MemoryPublisher, MemoryTransport

logger = logging.getLogger(__name__)

State = Literal["running", "dead", "taken_over", "stopped"]

# The simulated worker whose task is running: every task a worker's pipeline creates inherits it
# from the worker's serving task (its hooks, a fake external client, the Recorder read it).
_current: contextvars.ContextVar[SimulatedWorker | None] = contextvars.ContextVar(
    "dedupe_testing_worker", default=None
)


def current_worker() -> SimulatedWorker | None:
    """The simulated worker running the calling code, if any."""
    return _current.get()


class WorkerDied(BaseException):
    """The simulated worker process died at a crash point: nothing after it happens.

    A BaseException, so that no handler's or pipeline's `except Exception` takes it for an
    error to recover from.
    """


class _Store(ClaimStore):
    """A worker's claim store whose heartbeats wait while the worker is frozen."""

    def __init__(self, pool: asyncpg.Pool, *, owner: str) -> None:
        super().__init__(pool, owner=owner)
        self.awake = asyncio.Event()
        self.awake.set()

    async def heartbeat(self, leases: Sequence[tuple[Fence, float]]) -> set[KeyId]:
        await self.awake.wait()
        return await super().heartbeat(leases)


class SimulatedWorker:
    """One worker process of a test run: `name` for people, `owner` in the claims table."""

    def __init__(
        self,
        app: App,
        broker: MemoryBroker,
        database_url: str,
        *,
        name: str,
        concurrency: int,
        context: contextvars.Context,
    ) -> None:
        self.app = app
        self.name = name
        self.owner = f"worker-{name}"
        self.state: State = "running"
        self.frozen = False
        self.transport: MemoryTransport = broker.transport(name)
        # Its outbox relay's connection to the broker (ctx.publish): gone when it dies.
        self.publisher: MemoryPublisher = broker.publisher()
        self._database_url = database_url
        self._concurrency = concurrency
        self._context = context
        self._stop = asyncio.Event()
        self._store: _Store | None = None
        self._processor: Processor | None = None
        self._serving: asyncio.Task[None] | None = None
        self._resources = contextlib.AsyncExitStack()

    @property
    def stats(self) -> Stats:
        """What its pipeline decided (completed, duplicates, taken over, fenced, ...)."""
        assert self._processor is not None, "the worker has not started"
        return self._processor.stats

    @property
    def live(self) -> bool:
        """Whether the broker still counts on it (running, frozen or not)."""
        return self.state == "running"

    @property
    def busy(self) -> bool:
        """Whether it has runs under way that will go on by themselves (not frozen, not dead)."""
        return self.state != "dead" and not self.frozen and self.transport.in_flight > 0

    async def start(self) -> None:
        """Connect, start the pipeline and consume the app's channels."""
        self._context.run(_current.set, self)
        try:
            pool = await connect_pool(self._database_url, max_size=self._concurrency + 4)
            self._resources.push_async_callback(pool.close)
            self._store = _Store(pool, owner=self.owner)
            processor = Processor(
                self.app,
                self._store,
                concurrency=self._concurrency,
                gc_interval_s=None,
                publisher=self.publisher,
            )
            # Entered in the worker's context, so that its heartbeat is recognisably its own.
            await asyncio.create_task(processor.__aenter__(), context=self._context)
            self._resources.push_async_callback(processor.__aexit__, None, None, None)
            self._processor = processor
            self._resources.push_async_callback(self.transport.close)
            self._serving = asyncio.create_task(
                self.transport.serve(list(self.app.channels), processor.process, self._stop),
                name=f"dedupe-testing-{self.name}",
                context=self._context,
            )
        except BaseException:
            await self._resources.aclose()
            raise

    def die(self) -> None:
        """Die now, as a killed process does (synchronous: nothing else runs before it)."""
        if self.state == "dead":
            return
        self.state = "dead"
        self.frozen = False
        self.transport.disconnect(cancel=True)
        self.publisher.connected = False
        if self._store is not None:
            self._store.pool.terminate()
        self._stop.set()

    def freeze(self) -> None:
        """Stop heartbeating (its runs pause where they are told to)."""
        self.frozen = True
        if self._store is not None:
            self._store.awake.clear()

    def thaw(self) -> None:
        self.frozen = False
        if self._store is not None:
            self._store.awake.set()

    def lose_to_another(self) -> None:
        """The broker gives up on it (as after a missed heartbeat): what it has not settled
        goes to another worker and whatever it settles from now on is dropped. It runs on."""
        if self.state == "running":
            self.state = "taken_over"
            self.transport.disconnect()

    async def close(self, *, timeout_s: float = 5.0) -> None:
        """Stop: gracefully if it lives (runs under way get `timeout_s`); a dead one only has
        its tasks ended (its connections are gone: nothing reaches the database)."""
        if self.frozen:
            self.die()  # a frozen run would never finish: end it as a kill would
        self._stop.set()
        if self._serving is not None:
            with contextlib.suppress(BaseException):
                await self._serving
        if self._processor is not None and self.state != "dead":
            await self._processor.drain(timeout_s=timeout_s)
        if self.state != "dead":
            self.state = "stopped"
        await self._resources.aclose()


__all__ = ["SimulatedWorker", "State", "WorkerDied", "current_worker"]
