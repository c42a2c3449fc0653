"""`dedupe-worker run`: consume the app's channels under the claim protocol."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .. import tracing
from ..activity import Activity
from ..errors import DedupeError
from ..metrics import Metrics
from ..observe import Observer
from ..pipeline import Processor
from ..settings import Settings
from ..store import ClaimStore, connect_pool, redact
from ..transport import Transport
from .options import check_migrated, load_app, logger, make_transport, retrying


async def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    app = load_app(args.app)
    transport = make_transport(settings, app_name=app.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            logger.info(
                "%s received: finishing in-flight messages (up to %gs); send it again to "
                "stop at once",
                signal.Signals(signum).name,
                settings.shutdown_timeout_s,
            )
            stop.set()
        else:
            logger.warning("second signal: giving in-flight messages back now")
            drain_now.set()

    drain_now = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    pool = await retrying(
        "PostgreSQL",
        lambda: connect_pool(settings.database_url, max_size=settings.concurrency + 4),
        settings.connect_timeout_s,
    )
    async with pool:
        store = ClaimStore(pool, owner=settings.worker_name)
        await check_migrated(store)
        metrics = Metrics()
        tracer = tracing.tracer_for(store)
        activity = Activity(store)
        observers: list[Observer] = [activity]
        if settings.metrics_port:
            observers.append(metrics)
        if tracer is not None:
            observers.append(tracer)
        async with (
            activity,
            tracer or contextlib.nullcontext(),
            Processor(
                app,
                store,
                concurrency=settings.concurrency,
                gc_interval_s=settings.gc_interval_s or None,
                observers=observers,
            ) as processor,
            _metrics_served(metrics, processor, store, settings),
        ):
            await _connect_broker(transport, settings)
            logger.info(
                "worker %s running app %r on %s: %s",
                settings.worker_name,
                app.name,
                type(asyncio.get_running_loop()).__module__.split(".")[0],
                ", ".join(
                    f"{h.name} <- {h.channel} (key={h.key_spec})" for h in app.handlers.values()
                ),
            )
            serving = asyncio.create_task(
                transport.serve(list(app.channels), processor.process, stop), name="serve"
            )
            reporter = asyncio.create_task(_report(processor, settings.stats_interval_s))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if serving.done() and not stop.is_set():
                stop.set()
                serving.result()  # the transport failed: raise its error
            drain = asyncio.create_task(processor.drain(timeout_s=settings.shutdown_timeout_s))
            forced = asyncio.create_task(drain_now.wait())
            await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
            if not drain.done():
                drain.cancel()
                await processor.drain(timeout_s=0)
            forced.cancel()
            await serving
            reporter.cancel()
            await transport.close()
    logger.info("stopped; %s", json.dumps(processor.stats.snapshot()))
    return 0


async def _connect_broker(transport: Transport, settings: Settings) -> None:
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


def broker_unreachable(settings: Settings, exc: BaseException) -> DedupeError:
    """The error to show when the broker cannot be reached: where, why, and what to do."""
    return DedupeError(
        f"cannot reach the broker at {redact(settings.broker_url)}: {exc}. Is it "
        "running (`make services`)? Set the URL with --broker or DEDUPE_BROKER_URL."
    )


async def _report(processor: Processor, interval_s: float) -> None:
    if interval_s <= 0:
        return
    last: dict[str, Any] = {}
    while True:
        await asyncio.sleep(interval_s)
        snapshot = processor.stats.snapshot()
        if snapshot != last:
            logger.info("progress: %s in flight, %s", processor.in_flight, json.dumps(snapshot))
            last = snapshot


@contextlib.asynccontextmanager
async def _metrics_served(
    metrics: Metrics, processor: Processor, store: ClaimStore, settings: Settings
) -> AsyncIterator[None]:
    """Serve /metrics while the worker runs (only with --metrics-port)."""
    if not settings.metrics_port:
        yield
        return
    metrics.watch_processor(processor)
    served = metrics.serve(settings.metrics_host, settings.metrics_port)
    checking = asyncio.create_task(
        metrics.check_claims_every(store, settings.metrics_interval_s), name="dedupe-metrics"
    )
    try:
        yield
    finally:
        checking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checking
        served.stop()
