"""The in-process API: run an app on a broker and a database inside your own service.

    from dedupe import Worker

    async with Worker(app, broker_url="amqp://guest:guest@127.0.0.1/",
                      database_url="postgresql://...") as worker:
        await worker.wait()          # or serve your API meanwhile (a FastAPI lifespan)

Leaving the block stops gracefully: no new deliveries, claims not yet running are given back
at once, runs under way get `shutdown_timeout_s`, then their keys are given back too. What
comes after the runs (the give-backs, the broker's and the database's goodbyes) gets
`STOP_GRACE_S` (12 s); then the pool's connections are dropped and what still waits gets
12 s more: a network that swallows packets cannot hold a stopping worker.
`dedupe-worker run` is this, plus signal handling, metrics and the progress line.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg
import pydantic

from dedupe.app import App
from dedupe.claims.database import check_schema, connect_pool, redact
from dedupe.claims.store import ClaimStore
from dedupe.errors import DedupeError, InvalidOption, unknown_option
from dedupe.observability import tracing
from dedupe.observability.activity import Activity
from dedupe.pipeline.observers import Observer
from dedupe.pipeline.processor import Processor
from dedupe.pipeline.stats import Stats
from dedupe.plugins import transport_plugin
from dedupe.settings import Settings, invalid_settings
from dedupe.transport import Publisher, Transport

logger = logging.getLogger("dedupe.worker")

T = TypeVar("T")


async def retrying(what: str, connect: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """Connect, retrying with backoff for up to timeout_s: services may start after us."""
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while True:
        try:
            return await connect()
        except (OSError, DedupeError, ConnectionError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            logger.warning("%s not reachable yet (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


# Pooled connections opened, with the claim statements planned, before the first delivery.
WARM_CONNECTIONS = 8
# After shutdown_timeout_s, the longest a stop waits for the give-backs and goodbyes (the
# runs' keys, the transport's end, the buffers' last flush, the pool's close) on a network
# that neither answers nor closes.
STOP_GRACE_S = 12.0


def freeze_startup_heap() -> None:
    """Leave what is alive once a worker has started (modules, the app, pools, prepared
    statements) out of every later garbage collection (`gc.freeze()`).

    A full collection walks every tracked object: in a started worker it paused the event loop
    for 20-40 ms every few seconds, a stall every message in flight then waited out. After
    the freeze no pause over 5 ms was seen (a 10 s Kafka run at 1,000 msg/s). `dedupe-worker
    run` calls it once started; a service embedding `Worker` may call it once after its own
    start-up (once per process: objects frozen and later dropped in a reference cycle are never
    collected; `gc.unfreeze()` undoes it).
    """
    gc.collect()
    gc.freeze()


async def check_migrated(store: ClaimStore, database_url: str | None = None) -> None:
    """The schema gate: raise dedupe.errors.SchemaMismatch, naming `dedupe-worker migrate` and
    both versions, unless the database has exactly the migrations this code ships (never
    migrated, migrations pending, or migrated by a newer dedupe-worker all refuse)."""
    await check_schema(store.pool, where=None if database_url is None else redact(database_url))


def broker_unreachable(settings: Settings, exc: BaseException) -> DedupeError:
    """The error to show when the broker cannot be reached: where, why, and what to do."""
    return DedupeError(
        f"cannot reach the broker at {redact(settings.broker_url)}: {exc}. Is it "
        "running (`make services`)? Set the URL with --broker or DEDUPE_BROKER_URL."
    )


class Worker:
    """An app consuming its channels in this event loop until the `async with` block ends.

    Every worker records its activity for operators (duplicates, conflicts: `dedupe-worker
    status`, the status page) and traces with OpenTelemetry when it is installed.

    Args:
        app: The handlers to run.
        settings: Every option (dedupe.settings.Settings); keyword arguments override its
            fields (broker_url=, database_url=, concurrency=, ...). Without settings they are
            read from the DEDUPE_* variables.
        observers: Metrics, or your own dedupe.pipeline.observers.Observer.
        transport: A transport to use instead of the one the broker URL's scheme names.
        publisher: The outbox relay's publisher (ctx.publish), likewise.
    """

    def __init__(
        self,
        app: App,
        *,
        settings: Settings | None = None,
        observers: Sequence[Observer] = (),
        transport: Transport | None = None,
        publisher: Publisher | None = None,
        **options: Any,
    ) -> None:
        for option in options:  # a typo (concurency=4) is an error, not a default
            if option not in Settings.model_fields:
                valid = [*Settings.model_fields, "settings", "observers", "transport", "publisher"]
                raise unknown_option("Worker", option, valid)
        try:
            if settings is None:
                self.settings = Settings(**options)  # the DEDUPE_* variables, then these
            else:
                self.settings = (
                    Settings(**{**settings.model_dump(), **options}) if options else settings
                )
        except pydantic.ValidationError as exc:  # one root: DedupeError (and still ValueError)
            raise InvalidOption(f"Worker: {invalid_settings(exc)}") from exc
        self.app = app
        self._observers = list(observers)
        self._transport = transport
        self._publisher = publisher
        self._processor: Processor | None = None
        self._serving: asyncio.Task[None] | None = None
        self._pool: asyncpg.Pool | None = None
        self._stop = asyncio.Event()
        self._stopped = False
        self._resources = contextlib.AsyncExitStack()

    @property
    def processor(self) -> Processor:
        """The pipeline (its stats stay readable after the worker stopped)."""
        if self._processor is None:
            raise RuntimeError("the worker has not started: use `async with Worker(...)`")
        return self._processor

    @property
    def stats(self) -> Stats:
        return self.processor.stats

    async def __aenter__(self) -> Worker:
        settings = self.settings
        try:
            if self._transport is None or self._publisher is None:
                plugin = transport_plugin(settings.broker_url)
                if self._transport is None:
                    self._transport = plugin.transport(settings, app_name=self.app.name)
                if self._publisher is None:
                    self._publisher = plugin.publisher(settings)
            self._resources.push_async_callback(self._publisher.close)
            pool = await retrying(
                "PostgreSQL",
                lambda: connect_pool(settings.database_url, max_size=settings.concurrency + 4),
                settings.connect_timeout_s,
            )
            self._pool = pool
            self._resources.push_async_callback(pool.close)
            store = ClaimStore(pool, owner=settings.worker_name)
            await check_migrated(store, settings.database_url)  # before a delivery is taken
            # The first messages after a start would otherwise wait for connects and planning.
            await store.warm_up(WARM_CONNECTIONS)
            activity = await self._resources.enter_async_context(Activity(store))
            observers: list[Observer] = [activity, *self._observers]
            tracer = tracing.tracer_for(store)
            if tracer is not None:
                observers.append(await self._resources.enter_async_context(tracer))
                self._resources.callback(tracer.watch(self.app))  # a run's span, current
            self._processor = await self._resources.enter_async_context(
                Processor(
                    self.app,
                    store,
                    concurrency=settings.concurrency,
                    gc_interval_s=settings.gc_interval_s or None,
                    park_after_s=settings.park_after_s,
                    observers=observers,
                    publisher=self._publisher,
                )
            )
            self._resources.push_async_callback(self._transport.close)
            await self._connect_broker()
            self._serving = asyncio.create_task(
                self._transport.serve(list(self.app.channels), self._processor.process, self._stop),
                name="dedupe-serve",
            )
        except BaseException:
            self._stopped = True
            await self._resources.aclose()
            raise
        return self

    async def _connect_broker(self) -> None:
        transport, settings = self._transport, self.settings
        connect: Callable[[], Awaitable[None]] | None = getattr(transport, "connect", None)
        if connect is None:
            return

        async def attempt() -> None:
            assert connect is not None
            try:
                await connect()
            except Exception as exc:
                raise broker_unreachable(settings, exc) from exc

        await retrying("broker", attempt, settings.connect_timeout_s)

    async def wait(self) -> None:
        """Run until stop() or request_stop() (or the transport fails: its error is raised)."""
        if self._serving is None:
            raise RuntimeError("the worker has not started: use `async with Worker(...)`")
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({self._serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if self._serving.done() and not self._stop.is_set():
            self._stop.set()
            self._serving.result()  # the transport failed: raise its error

    def request_stop(self) -> None:
        """Stop taking deliveries and let wait() return; safe to call from a signal handler."""
        self._stop.set()

    async def stop(
        self, *, timeout_s: float | None = None, now: asyncio.Event | None = None
    ) -> None:
        """Stop gracefully: runs under way get `timeout_s` (default: shutdown_timeout_s), or
        less if `now` is set meanwhile (a second signal). Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        loop = asyncio.get_running_loop()
        limit = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        # The runs get `limit`; the give-backs and goodbyes after them STOP_GRACE_S. Past both,
        # a path that neither answers nor closes is cut here: the pool's connections are
        # dropped, so whatever still waits on them fails at once and the stop goes on.
        cut_at = loop.time() + limit + STOP_GRACE_S
        watchdog = loop.call_at(cut_at, self._cut_the_database)
        try:
            processor = self._processor
            if processor is not None:
                drain = asyncio.create_task(processor.drain(timeout_s=limit))
                forced = asyncio.ensure_future(now.wait()) if now is not None else None
                await asyncio.wait(
                    {drain} if forced is None else {drain, forced},
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not drain.done():  # a second signal: the runs' time is over
                    watchdog.cancel()
                    cut_at = loop.time() + STOP_GRACE_S
                    watchdog = loop.call_at(cut_at, self._cut_the_database)
                    drain.cancel()
                    await processor.drain(timeout_s=0)
                if forced is not None:
                    forced.cancel()
            if self._serving is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self._serving
            try:
                # Past the cut, the goodbyes get one more grace; what still waits then is left.
                async with asyncio.timeout_at(cut_at + STOP_GRACE_S):
                    await self._resources.aclose()
            except TimeoutError:
                logger.warning("stopping: the connections' goodbyes did not end; left behind")
        finally:
            watchdog.cancel()

    def _cut_the_database(self) -> None:
        pool = self._pool
        logger.warning(
            "stopping: PostgreSQL did not answer within %.0fs of the runs' time; the pool's "
            "connections are dropped (the server releases what they held when it sees them "
            "gone; keys not given back are taken over when their leases lapse)",
            STOP_GRACE_S,
        )
        if pool is not None:
            with contextlib.suppress(Exception):  # closed already
                pool.terminate()
        # What waited on the pool (a statement, a free connection) waits no more: the runs and
        # the transport's batches still under way are cancelled, their messages redelivered.
        if self._serving is not None and not self._serving.done():
            self._serving.cancel()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


__all__ = ["Worker", "broker_unreachable", "check_migrated", "freeze_startup_heap", "retrying"]
