"""Operator commands: migrate, gc, claims list|show|release, dlq list|replay."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..operations import FINISHED, ClaimAdmin
from ..plugins import TransportPlugin, transport_plugin
from ..settings import Settings
from ..store import ClaimStore, migrate
from ..worker import broker_unreachable
from .options import cell, confirm, print_rows


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    applied = await migrate(settings.database_url)
    if applied:
        print(f"applied {len(applied)} migration(s): {', '.join(applied)}")
    else:
        print("database is up to date")
    return 0


async def cmd_gc(args: argparse.Namespace, settings: Settings) -> int:
    async with ClaimStore.open(settings.database_url, owner="gc") as store:
        deleted = await store.gc(batch_size=args.batch_size, max_batches=args.max_batches)
    if deleted is None:
        print("another clean-up is running; nothing done")
    else:
        print(f"deleted {deleted} expired claim(s)")
    return 0


async def cmd_claims(args: argparse.Namespace, settings: Settings) -> int:
    async with ClaimStore.open(settings.database_url, owner="admin") as store:
        if args.claims_command == "list":
            rows = await store.list_claims(
                scope=args.scope,
                status=args.status,
                older_than_s=args.older_than_s,
                limit=args.limit,
            )
            if args.json:
                print(json.dumps(rows, default=str, indent=2))
            elif rows:
                print_rows(rows, ["scope", "key", "status", "attempts", "age_s", "owner", "error"])
            else:
                print("no claims match")
            return 0
        if args.claims_command == "show":
            row = await ClaimAdmin(store).show(args.scope, args.key)
            if row is None:
                print(f"no claim for scope {args.scope!r} key {args.key!r}", file=sys.stderr)
                return 1
            if args.table:
                _print_claim(row)
            else:
                print(json.dumps(row, default=str, indent=2))
            return 0
        if args.claims_command == "purge":
            return await _purge(args, ClaimAdmin(store))
        # release
        if not args.yes and not confirm(
            f"release {args.scope}/{args.key} so that the next delivery runs it again?"
        ):
            print("nothing done")
            return 1
        status = await store.release(args.scope, args.key)
        if status is None:
            row = await store.show_claim(args.scope, args.key)
            if row is None:
                print(f"no claim for scope {args.scope!r} key {args.key!r}", file=sys.stderr)
            else:
                print(
                    f"{args.scope}/{args.key} is {row['status']}: completed keys are never "
                    "released (their effects happened)",
                    file=sys.stderr,
                )
            return 1
        print(f"released {args.scope}/{args.key} (was {status}); the next delivery claims it")
        return 0


def _print_claim(row: dict[str, Any]) -> None:
    history = row.pop("history")
    width = max(len(name) for name in row)
    for name, value in row.items():
        print(f"{name.ljust(width)}  {cell(value) if name != 'result' else value or '-'}")
    print()
    if history:
        print("history:")
        print_rows(history, ["at", "event", "token", "owner", "attempts", "detail"])
    else:
        print("history: none (claimed once, no take-over, retry, failure or release)")


async def _purge(args: argparse.Namespace, admin: ClaimAdmin) -> int:
    statuses = [args.status] if args.status else list(FINISHED)
    where = f" of {args.scope}" if args.scope else ""
    if not args.yes and not confirm(
        f"delete {' and '.join(statuses)} claims{where} untouched for {args.older_than_s:g}s? "
        "A later duplicate of a deleted key runs its handler again"
    ):
        print("nothing done")
        return 1
    deleted = await admin.purge(older_than_s=args.older_than_s, statuses=statuses, scope=args.scope)
    print(f"purged {deleted} claim(s)")
    return 0


async def cmd_dlq(args: argparse.Namespace, settings: Settings) -> int:
    plugin = transport_plugin(settings.broker_url)
    try:
        return await _dlq(args, settings, plugin)
    except plugin.unreachable as exc:
        raise broker_unreachable(settings, exc) from exc


async def _dlq(args: argparse.Namespace, settings: Settings, plugin: TransportPlugin) -> int:
    broker = plugin.admin(settings.broker_url)
    if args.dlq_command == "list":
        rows = await broker.peek_dead_letters(args.channel, limit=args.limit)
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
        elif rows:
            print_rows(rows, ["message_id", "reason", "scope", "key", "detail"])
        else:
            kept = " (nothing left to replay)" if plugin.dead_letters_kept else ""
            print(f"{args.channel}.dlq is empty{kept}")
        return 0
    if not args.yes and not confirm(
        f"move up to {args.limit} dead letters back to {args.channel}?"
    ):
        print("nothing done")
        return 1
    released: list[str] = []
    async with ClaimStore.open(settings.database_url, owner="admin") as store:

        async def release(scope: str, key: str) -> None:
            if await store.release_failed(scope, key):
                released.append(key)

        moved = await broker.replay_dead_letters(args.channel, limit=args.limit, release=release)
    print(
        f"replayed {len(moved)} dead letter(s) to {args.channel}; released {len(released)} "
        "failed claim(s) so they run again"
    )
    return 0
