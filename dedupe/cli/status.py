"""`dedupe-worker status`: the claims at a glance, printed or served as the status page."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from dedupe.claims.store import ClaimStore
from dedupe.cli.options import print_rows
from dedupe.cli.serving import serve_until_stopped
from dedupe.operations.claims import ClaimAdmin
from dedupe.plugins import Serving, server
from dedupe.settings import Settings
from dedupe.worker import check_migrated


async def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    async with ClaimStore.open(settings.database_url, owner="status") as store:
        await check_migrated(store, settings.database_url)
        if args.serve:
            return await _serve(store, settings)
        admin = ClaimAdmin(store)
        overview = await admin.overview()
        stuck = await admin.stuck(older_than_s=args.stuck_after_s)
        recent = await admin.recent(("conflict", "failed", "dead_lettered"), limit=args.limit)
        outbox = await admin.outbox(limit=args.limit)
    if args.json:
        document = {"handlers": overview, "stuck": stuck, "recent": recent, "outbox": outbox}
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
    if recent:
        print_rows(recent, ["at", "event", "scope", "key", "reason", "detail"])
    else:
        print("none")
    print(f"\noutbox: {outbox_summary(outbox)}")
    if outbox["channels"]:
        print_rows(
            outbox["channels"], ["channel", "unsent", "oldest_unsent_s", "refused", "last_error"]
        )
    return 0


def outbox_summary(backlog: dict[str, Any]) -> str:
    """One line on the outbox's backlog (ctx.publish): what waits, how long, what was refused."""
    lag = backlog.get("cleanup_lag_s") or 0
    cleanup = f"; sent rows past their retention waiting {lag:.0f} s for clean-up" if lag else ""
    if not backlog["unsent"]:
        return "nothing waiting to be relayed" + cleanup
    return (
        f"{backlog['unsent']} unsent, the oldest {backlog['oldest_unsent_s']:.0f} s old, "
        f"{backlog['refused']} refused by the broker at least once{cleanup}"
    )


async def _serve(store: ClaimStore, settings: Settings) -> int:
    serving = Serving(settings=settings, store=store, stop=asyncio.Event(), force=asyncio.Event())
    return await serve_until_stopped(server("status"), serving)
