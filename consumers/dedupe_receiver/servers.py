"""The HTTP servers the CLI starts (`dedupe.servers`): the webhook receiver and the status page.

Both run under uvicorn without signal handlers of their own: the CLI installs those, in one
place, and sets `Serving.stop` (finish open requests, then return) and `Serving.force` (close
open connections now).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import RedirectResponse
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the webhook receiver and the status page need starlette and uvicorn: "
        "pip install 'dedupe-worker[receiver]'"
    ) from exc

from dedupe.errors import ConfigurationError
from dedupe.plugins import Serving
from dedupe.worker import freeze_startup_heap
from dedupe_receiver.application import create_receiver
from dedupe_receiver.status_page import StatusPage

logger = logging.getLogger(__name__)

# uvicorn's HTTP/1.1 protocol (`receive --http`): h11, the default, bounds a request's head (an
# unfinished head past 16 KiB gets 400); httptools parses faster but keeps whatever head a client
# sends (a 32 MiB header line is read in full), for a receiver behind a proxy that bounds heads.


class _QuietServer(uvicorn.Server):
    """uvicorn without signal handlers of its own: the CLI's set Serving.stop and .force."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve(config: uvicorn.Config, serving: Serving) -> bool:
    """Serve until `stop` (then let open requests finish) or `force`; True if it started."""
    server = _QuietServer(config)

    async def watch() -> None:
        await serving.stop.wait()
        server.should_exit = True
        await serving.force.wait()
        server.force_exit = True

    watching = asyncio.create_task(watch(), name="dedupe-server-stop")
    try:
        await server.serve()
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
    return bool(server.started)


async def serve_receiver(serving: Serving) -> bool:
    """`dedupe-worker receive`: the app's webhook sources on receiver_host:receiver_port."""
    if serving.app is None or serving.publisher is None:
        raise ConfigurationError("the receiver needs the app and a publisher")
    settings = serving.settings
    publisher = serving.publisher
    token = settings.status_token.get_secret_value() if settings.status_token else None
    asgi = create_receiver(
        serving.app,
        store=serving.store,
        publisher=lambda: publisher,  # a factory: the receiver's lifespan opens and closes it
        owner=settings.worker_name,
        store_timeout_s=serving.store_timeout_s,
        status_token=token,
        serve_status=serving.serve_status,
        serve_metrics=serving.serve_metrics,
        metrics_interval_s=settings.metrics_interval_s,
    )
    _freeze_once_started(asgi)
    config = uvicorn.Config(
        asgi,
        host=settings.receiver_host,
        port=settings.receiver_port,
        lifespan="on",
        http=serving.http,
        log_config=None,  # our logging.basicConfig, not uvicorn's
        access_log=False,  # per-request lines at DEBUG come from the receiver
        server_header=False,
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
    )
    started = await _serve(config, serving)
    stats = asgi.state.receiver.stats
    logger.info("receiver stopped; %s", json.dumps(dict(stats)))
    return started


def _freeze_once_started(asgi: Starlette) -> None:
    """Once the receiver's lifespan has started (store and publisher open), leave what is
    alive out of every later garbage collection, as `dedupe-worker run` does once its worker
    has (dedupe.worker.freeze_startup_heap): without it each full collection walked the whole
    start-up heap, pausing every request in flight."""
    started = asgi.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[Any]:
        async with started(app) as state:
            freeze_startup_heap()
            yield state

    asgi.router.lifespan_context = lifespan


async def serve_status(serving: Serving) -> bool:
    """`dedupe-worker status --serve`: the status page on status_host:status_port."""
    settings = serving.settings
    token = settings.status_token.get_secret_value() if settings.status_token else None
    page = StatusPage(serving.store, token=token)

    async def home(_request: object) -> RedirectResponse:
        return RedirectResponse("/status")

    asgi = Starlette(routes=[Route("/", home), *page.routes()])
    config = uvicorn.Config(
        asgi,
        host=settings.status_host,
        port=settings.status_port,
        http="h11",  # a bounded request head (see above)
        log_config=None,
        access_log=False,
        server_header=False,
    )
    logger.info(
        "status page on http://%s:%d/status (release: %s)",
        settings.status_host,
        settings.status_port,
        "with the status token" if token else "loopback clients only",
    )
    return await _serve(config, serving)


__all__ = ["serve_receiver", "serve_status"]
