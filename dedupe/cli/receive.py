"""`dedupe-worker receive`: the webhook receiver, served by the `receiver` server plugin."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util

from dedupe.claims.database import connect_pool
from dedupe.claims.store import ClaimStore
from dedupe.cli.options import UsageError, load_app, make_publisher
from dedupe.cli.serving import serve_until_stopped
from dedupe.errors import ConfigurationError
from dedupe.plugins import Serving, server
from dedupe.settings import Settings
from dedupe.worker import check_migrated, retrying


async def cmd_receive(args: argparse.Namespace, settings: Settings) -> int:
    serve = server("receiver")  # a missing extra stops us before anything connects
    if args.http == "httptools" and importlib.util.find_spec("httptools") is None:
        raise UsageError("--http httptools: httptools is not installed; pip install httptools")
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
        await check_migrated(store, settings.database_url)
        serving = Serving(
            settings=settings,
            store=store,
            stop=asyncio.Event(),
            force=asyncio.Event(),
            app=app,
            publisher=publisher,
            store_timeout_s=args.store_timeout_s,
            http=args.http,
            serve_status=not args.no_status,
            serve_metrics=not args.no_metrics,
        )
        return await serve_until_stopped(serve, serving)
