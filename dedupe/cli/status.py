"""`dedupe-worker status`: the claims at a glance, printed or served as the status page."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Iterator

from ..operations import ClaimAdmin
from ..settings import Settings
from ..store import ClaimStore
from .options import UsageError, check_migrated, logger, print_rows


async def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    async with ClaimStore.open(settings.database_url, owner="status") as store:
        await check_migrated(store)
        if args.serve:
            return await _serve(store, settings)
        admin = ClaimAdmin(store)
        overview = await admin.overview()
        stuck = await admin.stuck(older_than_s=args.stuck_after_s)
        recent = await admin.recent(("conflict", "failed", "dead_lettered"), limit=args.limit)
    if args.json:
        document = {"handlers": overview, "stuck": stuck, "recent": recent}
        print(json.dumps(document, default=str, indent=2))
        return 0
    columns = ["handler", "in_progress", "completed", "failed", "duplicates", "conflicts"]
    print_rows(overview, columns) if overview else print("no claims yet")
    print(f"\nin progress for more than {args.stuck_after_s:g}s:")
    if stuck:
        print_rows(stuck, ["scope", "key", "age_s", "owner", "attempts", "lease_lapsed"])
    else:
        print("none")
    print("\nrecent conflicts and dead letters:")
    print_rows(recent, ["at", "event", "scope", "key", "detail"]) if recent else print("none")
    return 0


async def _serve(store: ClaimStore, settings: Settings) -> int:
    try:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import RedirectResponse
        from starlette.routing import Route

        from consumers.status_page import StatusPage
    except ImportError as exc:
        raise UsageError(
            f"the status page needs the receiver extra: pip install 'dedupe-worker[receiver]' "
            f"({exc})"
        ) from exc
    token = settings.status_token.get_secret_value() if settings.status_token else None
    page = StatusPage(store, token=token)

    async def home(_request: object) -> RedirectResponse:
        return RedirectResponse("/status")

    asgi = Starlette(routes=[Route("/", home), *page.routes()])
    config = uvicorn.Config(
        asgi,
        host=settings.status_host,
        port=settings.status_port,
        log_config=None,
        access_log=False,
        server_header=False,
    )

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = QuietServer(config)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, setattr, server, "should_exit", True)
    logger.info(
        "status page on http://%s:%d/status (release: %s)",
        settings.status_host,
        settings.status_port,
        "with the status token" if token else "loopback clients only",
    )
    await server.serve()
    return 0 if server.started else 1
