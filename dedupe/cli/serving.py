"""The CLI's HTTP servers (receive, status --serve): found by entry point, stopped by signals."""

from __future__ import annotations

import asyncio
import signal

from dedupe.cli.options import logger
from dedupe.plugins import Server, Serving


def stop_on_signals(stop: asyncio.Event, force: asyncio.Event) -> None:
    """SIGTERM or SIGINT sets `stop` (open requests finish); a second one sets `force`."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("second signal: closing open connections now")
            force.set()
        else:
            logger.info(
                "%s received: finishing open requests, then stopping", signal.Signals(signum).name
            )
            stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


async def serve_until_stopped(serve: Server, serving: Serving) -> int:
    """Run the server until a signal stops it: 0 once it served, 1 if it could not start."""
    stop_on_signals(serving.stop, serving.force)
    return 0 if await serve(serving) else 1
