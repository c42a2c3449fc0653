"""`dedupe-worker receive`: the webhook receiver under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Iterator

from ..errors import ConfigurationError
from ..settings import Settings
from ..store import ClaimStore, connect_pool
from .options import UsageError, check_migrated, load_app, logger, make_publisher, retrying


async def cmd_receive(args: argparse.Namespace, settings: Settings) -> int:
    try:
        import uvicorn

        from consumers.receiver import create_receiver
    except ImportError as exc:
        raise UsageError(
            f"the webhook receiver needs its extra: pip install 'dedupe-worker[receiver]' ({exc})"
        ) from exc
    app = load_app(args.app, need="webhooks")
    for source in app.webhooks.values():
        try:
            source.verify.check()  # a missing secret stops us here, not at the first request
        except ConfigurationError as exc:
            raise ConfigurationError(f"webhook source {source.name!r}: {exc}") from exc
    publisher = make_publisher(settings)
    pool = await retrying(
        "PostgreSQL",
        lambda: connect_pool(settings.database_url, max_size=args.pool_size),
        settings.connect_timeout_s,
    )
    async with pool:
        store = ClaimStore(pool, owner=settings.worker_name)
        await check_migrated(store)
        token = settings.status_token.get_secret_value() if settings.status_token else None
        asgi = create_receiver(
            app,
            store=store,
            publisher=lambda: publisher,
            owner=settings.worker_name,
            store_timeout_s=args.store_timeout_s,
            status_token=token,
            serve_status=not args.no_status,
            serve_metrics=not args.no_metrics,
            metrics_interval_s=settings.metrics_interval_s,
        )
        config = uvicorn.Config(
            asgi,
            host=settings.receiver_host,
            port=settings.receiver_port,
            lifespan="on",
            log_config=None,  # our logging.basicConfig, not uvicorn's
            access_log=False,  # per-request lines at DEBUG come from the receiver
            server_header=False,
            timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
        )

        class QuietServer(uvicorn.Server):
            """uvicorn without signal handlers of its own: ours are installed below."""

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        server = QuietServer(config)
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if server.should_exit:
                logger.warning("second signal: closing open connections now")
                server.force_exit = True
            else:
                logger.info(
                    "%s received: finishing open requests, then stopping",
                    signal.Signals(signum).name,
                )
                server.should_exit = True

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        await server.serve()
    stats = asgi.state.receiver.stats
    logger.info("receiver stopped; %s", json.dumps(dict(stats)))
    return 0 if server.started else 1
