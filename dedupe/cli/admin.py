"""Operator commands: migrate, gc, claims list|show|release, conflicts list|settle,
dlq list|replay."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import AsyncIterator
from typing import Any

from dedupe.claims.database import migrate, redact, schema_version
from dedupe.claims.store import ClaimStore
from dedupe.cli.options import cell, confirm, print_rows
from dedupe.errors import SchemaMismatch
from dedupe.operations.claims import FINISHED, ClaimAdmin, NotSettled
from dedupe.plugins import TransportPlugin, transport_plugin
from dedupe.settings import Settings
from dedupe.worker import broker_unreachable, check_migrated

# `migrate` and `migrate --check`: the database holds migrations this code does not know.
EXIT_NEWER = 3


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    if args.check:
        return await _check(settings)
    try:
        applied = await migrate(settings.database_url)
    except SchemaMismatch as exc:
        print(f"dedupe-worker: error: {exc}", file=sys.stderr)
        return EXIT_NEWER
    if applied:
        print(f"applied {len(applied)} migration(s): {', '.join(applied)}")
    else:
        print("database is up to date")
    return 0


async def _check(settings: Settings) -> int:
    """`migrate --check`: 0 up to date, 1 migrations pending, EXIT_NEWER newer than this code;
    one line saying which, and nothing changed."""
    async with ClaimStore.open(settings.database_url, owner="migrate", max_size=1) as store:
        version = await schema_version(store.pool)
    problem = version.problem(redact(settings.database_url))
    if problem is None:
        print(f"the database is up to date: schema version {version.needed}, nothing pending")
        return 0
    print(problem)
    return EXIT_NEWER if version.unknown else 1


@contextlib.asynccontextmanager
async def _store(settings: Settings, owner: str) -> AsyncIterator[ClaimStore]:
    """The claims database, once it passed the schema gate."""
    async with ClaimStore.open(settings.database_url, owner=owner) as store:
        await check_migrated(store, settings.database_url)
        yield store


async def cmd_gc(args: argparse.Namespace, settings: Settings) -> int:
    async with _store(settings, "gc") as store:
        cleaned = await store.gc(batch_size=args.batch_size, max_batches=args.max_batches)
    if cleaned is None:
        print("another clean-up is running; nothing done")
    else:
        print(
            f"deleted {cleaned.claims} expired claim(s) and {cleaned.outbox} sent outbox row(s) "
            "past their retention"
        )
    return 0


async def cmd_claims(args: argparse.Namespace, settings: Settings) -> int:
    async with _store(settings, "admin") as store:
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
                columns = [
                    "scope",
                    "key",
                    "status",
                    "attempts",
                    "age_s",
                    "owner",
                    "reason",
                    "error",
                ]
                print_rows(rows, columns)
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
    history, conflicts = row.pop("history"), row.pop("conflicts")
    width = max(len(name) for name in row)
    for name, value in row.items():
        shown = cell(value) if name not in ("result", "fingerprint") else value or "-"
        print(f"{name.ljust(width)}  {shown}")
    print()
    if history:
        print("history:")
        print_rows(history, ["at", "event", "token", "owner", "attempts", "reason", "detail"])
    else:
        print("history: none (claimed once, no take-over, retry, failure or release)")
    for conflict in conflicts:
        print()
        _print_conflict(conflict, f"{shlex.quote(row['scope'])} {shlex.quote(row['key'])}")


def _print_conflict(conflict: dict[str, Any], claim: str) -> None:
    """One conflict for people: both fingerprints, the paths that differ, how it stands."""
    state = conflict["settled"] or "unsettled"
    print(
        f"conflict #{conflict['id']} at {cell(conflict['at'])}, {conflict['deliveries']} "
        f"deliver{'y' if conflict['deliveries'] == 1 else 'ies'}, {state}:"
    )
    if conflict.get("http_request"):
        print(f"  request        {conflict['http_request']} (answered 422)")
    print(f"  this payload   {conflict['fingerprint']}")
    print(f"  the claim's    {conflict['claimed_fingerprint']}")
    diff = conflict["diff"]
    if diff:
        print(f"  differs at     {diff[0]}")
        for change in diff[1:]:
            print(f"                 {change}")
        if conflict["more"]:
            print(f"                 and {conflict['more']} more")
    if conflict["note"]:
        print(f"  note           {conflict['note']}")
    print("  (values are never shown: + added, - removed, ~ changed, with their JSON types)")
    kept = conflict["payload_bytes"]
    if not conflict["settled"]:
        how = "--discard" if kept is None else "--discard | --run-as NEW_KEY"
        second = "not kept" if kept is None else f"{kept} bytes kept"
        print(f"  second payload {second}; settle: dedupe-worker conflicts settle {claim} {how}")


async def cmd_conflicts(args: argparse.Namespace, settings: Settings) -> int:
    async with _store(settings, "admin") as store:
        admin = ClaimAdmin(store)
        if args.conflicts_command == "list":
            rows = await admin.conflicts(scope=args.scope, settled=args.all, limit=args.limit)
            if args.json:
                print(json.dumps(rows, default=str, indent=2))
            elif rows:
                for row in rows:
                    row["diff"] = "; ".join(row["diff"] or []) or row["note"]
                    if row["http_request"]:
                        row["diff"] = f"{row['http_request']}: {row['diff']}"
                print_rows(rows, ["id", "at", "scope", "key", "deliveries", "settled", "diff"])
            else:
                print("no conflicts" if args.all else "no unsettled conflicts")
            return 0
        what = f"run the second payload of {args.scope}/{args.key} as key {args.run_as!r}"
        if args.discard:
            what = f"discard the second payload of {args.scope}/{args.key}"
        if not args.yes and not confirm(f"{what}?"):
            print("nothing done")
            return 1
        try:
            settled = await admin.settle_conflict(
                args.scope,
                args.key,
                run_as=None if args.discard else args.run_as,
                conflict_id=args.conflict_id,
            )
        except NotSettled as exc:
            print(str(exc), file=sys.stderr)
            return 1
    if settled.http_request is not None:
        print(
            f"settled the conflict of {args.scope}/{args.key} (conflict #{settled.conflict_id}, "
            f"{settled.http_request}): its client was answered 422 and sends the request again "
            "under a new Idempotency-Key"
        )
    elif settled.message_id is None and settled.source is not None:
        print(
            f"discarded the second payload of {args.scope}/{args.key} (conflict "
            f"#{settled.conflict_id}): webhook source {settled.source} answered it 422 and "
            "published nothing"
        )
    elif settled.message_id is None:
        print(
            f"discarded the second payload of {args.scope}/{args.key} (conflict "
            f"#{settled.conflict_id}); its dead letter stays in {settled.channel}.dlq, where "
            "a replay would only be refused again"
        )
    else:
        print(
            f"the second payload of {args.scope}/{args.key} (conflict #{settled.conflict_id}) "
            f"goes to {settled.channel} as key {args.run_as}, message id {settled.message_id}: "
            "a running worker's outbox relay publishes it within seconds; follow it with "
            f"`dedupe-worker claims show {args.scope} {args.run_as}`"
        )
    return 0


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
    async with _store(settings, "admin") as store:

        async def release(scope: str, key: str) -> None:
            if await store.release_failed(scope, key):
                released.append(key)

        moved = await broker.replay_dead_letters(args.channel, limit=args.limit, release=release)
    print(
        f"replayed {len(moved)} dead letter(s) to {args.channel}; released {len(released)} "
        "failed claim(s) so they run again"
    )
    return 0
