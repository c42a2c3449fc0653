"""`dedupe-worker run`: dedupe.Worker with signal handling, metrics and a progress line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

from dedupe.cli.options import load_app, logger
from dedupe.observability.metrics import Metrics
from dedupe.pipeline.observers import Observer
from dedupe.pipeline.processor import Processor
from dedupe.settings import Settings
from dedupe.worker import Worker, freeze_startup_heap

__all__ = ["cmd_run"]


async def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    app = load_app(args.app)
    metrics = Metrics()
    observers: list[Observer] = [metrics] if settings.metrics_port else []
    worker = Worker(app, settings=settings, observers=observers)
    drain_now = asyncio.Event()
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
            worker.request_stop()
        else:
            logger.warning("second signal: giving in-flight messages back now")
            drain_now.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    async with worker:
        processor = worker.processor
        freeze_startup_heap()  # started: no later full collection walks all of this again
        async with _metrics_served(metrics, processor, settings):
            logger.info(
                "worker %s running app %r on %s: %s",
                settings.worker_name,
                app.name,
                type(loop).__module__.split(".")[0],
                ", ".join(
                    f"{h.name} <- {h.channel} (key={h.key_spec})" for h in app.handlers.values()
                ),
            )
            reporter = asyncio.create_task(_report(processor, settings.stats_interval_s))
            try:
                await worker.wait()
            finally:
                await worker.stop(now=drain_now)
                reporter.cancel()
    logger.info("stopped; %s", json.dumps(worker.stats.snapshot()))
    return 0


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
    metrics: Metrics, processor: Processor, settings: Settings
) -> AsyncIterator[None]:
    """Serve /metrics while the worker runs (only with --metrics-port)."""
    if not settings.metrics_port:
        yield
        return
    metrics.watch_processor(processor)
    served = metrics.serve(settings.metrics_host, settings.metrics_port)
    checking = asyncio.create_task(
        metrics.check_claims_every(processor.store, settings.metrics_interval_s),
        name="dedupe-metrics",
    )
    try:
        yield
    finally:
        checking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checking
        served.stop()
