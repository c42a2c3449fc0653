"""The operator commands' options and help: migrate, gc, claims list|show|release|purge,
conflicts list|settle, dlq."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeAlias

from dedupe.cli.admin import cmd_claims, cmd_conflicts, cmd_dlq, cmd_gc, cmd_migrate
from dedupe.cli.options import add_common, add_option

EXIT_STATUS = (
    "exit status: 0 on success, 1 when the command could not do what was asked (its message "
    "says why and what to do), 2 on a bad option or environment variable."
)
SCOPE_HELP = "the handler's scope as `claims list` shows it, e.g. shop.charge"
KEY_HELP = "the idempotency key, e.g. pay-42"
CHANNEL_HELP = "the handler's channel (queue or topic) whose dead letters, in <channel>.dlq, {}"
YES_HELP = "do not ask for confirmation (needed without a terminal)"
if TYPE_CHECKING:
    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def add_migrate(sub: Commands) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="create or update the tables dedupe-worker keeps in PostgreSQL",
        description="Create the tables dedupe-worker keeps in PostgreSQL (claims, their history, "
        "dead letters), or bring them up to date after an upgrade. Only the migrations not "
        "applied yet run, under a lock: it is safe to run again, and from several processes "
        "at once. Run it before the first worker starts: every worker, receiver, middleware "
        "and operator command refuses a database whose schema is older or newer than its own "
        "code's. --check changes nothing: it says whether migrations are pending (for deploy "
        "pipelines).",
        epilog="exit status: 0 when the database is (or was brought) up to date, 1 when "
        "migrations are pending (--check) or the command could not do what was asked (its "
        "message says why), 2 on a bad option or environment variable, 3 when the database "
        "was migrated by a newer dedupe-worker (this one knows fewer migrations: upgrade it).",
    )
    add_common(migrate, broker=False)
    add_option(
        migrate,
        "--check",
        action="store_true",
        default=False,
        help="apply nothing; exit 1 when migrations are pending, 3 when the database is newer "
        "than this dedupe-worker, 0 when it is up to date",
    )
    migrate.set_defaults(handler=cmd_migrate)


def add_gc(sub: Commands) -> None:
    gc = sub.add_parser(
        "gc",
        help="delete expired claims and sent outbox rows now (workers also do it periodically)",
        description="Delete the claims whose retention (the handler's retention_s) has passed, "
        "then the outbox rows relayed whose retention has passed (never one still to relay). "
        "Workers do it by themselves every --gc-interval-s; run it by hand, or from a "
        "scheduler when the workers run with --gc-interval-s 0. One clean-up runs at a time.",
        epilog=EXIT_STATUS,
    )
    add_common(gc, broker=False)
    add_option(gc, "--batch-size", type=int, default=1000, metavar="N", help="rows per DELETE")
    add_option(
        gc,
        "--max-batches",
        type=int,
        default=1000,
        metavar="N",
        help="stop after this many batches (the rest waits for the next clean-up)",
    )
    gc.set_defaults(handler=cmd_gc)


def add_claims(sub: Commands) -> None:
    claims = sub.add_parser(
        "claims",
        help="inspect and release idempotency keys",
        description="Look at the idempotency keys claimed in PostgreSQL, release the stuck or "
        "failed ones so they run again, and purge old finished ones.",
    )
    actions = claims.add_subparsers(dest="claims_command", metavar="ACTION", required=True)
    c_list = actions.add_parser(
        "list",
        help="list claims, newest first",
        description="List claims, newest first, with their status, attempts, age and owner.",
        epilog=EXIT_STATUS,
    )
    add_option(
        c_list,
        "--scope",
        "--handler",
        metavar="SCOPE",
        shown="all scopes",
        help="only this handler's scope (app.handler), its tenants included",
    )
    add_option(
        c_list,
        "--status",
        choices=["in_progress", "completed", "failed"],
        shown="all",
        help="only claims in this status",
    )
    add_option(
        c_list,
        "--older-than-s",
        type=float,
        metavar="SECONDS",
        shown="any age",
        help="only claims created at least this long ago",
    )
    add_option(c_list, "--limit", type=int, default=50, metavar="N", help="list at most this many")
    add_option(c_list, "--json", action="store_true", default=False, help="print JSON")

    c_show = actions.add_parser(
        "show",
        help="show one claim with its history and conflicts",
        description="Show one claim (status, attempts, owner, outcome, trace id, fingerprint) "
        "with its history of take-overs, retries, failures and releases and its conflicts "
        "(both fingerprints and the paths that differ), as JSON.",
        epilog=EXIT_STATUS,
    )
    c_show.add_argument("scope", help=SCOPE_HELP)
    c_show.add_argument("key", help=KEY_HELP)
    add_option(
        c_show,
        "--table",
        action="store_true",
        default=False,
        help="print a table for people instead of JSON",
    )

    c_release = actions.add_parser(
        "release",
        help="let a stuck or failed key run again (never a completed one)",
        description="Let a stuck (in progress) or failed key run again at its next delivery. "
        "Completed keys are never released: their effects happened. Asks first unless --yes.",
        epilog=EXIT_STATUS,
    )
    c_release.add_argument("scope", help=SCOPE_HELP)
    c_release.add_argument("key", help=KEY_HELP)
    c_release.add_argument("--yes", action="store_true", help=YES_HELP)

    c_purge = actions.add_parser(
        "purge",
        help="delete finished claims older than an age (never in-progress ones)",
        description="Delete completed and failed claims untouched for --older-than-s; "
        "in-progress ones are never deleted. A later duplicate of a deleted key runs its "
        "handler again: keep the age longer than any redelivery. Asks first unless --yes.",
        epilog=EXIT_STATUS,
    )
    c_purge.add_argument(
        "--older-than-s",
        type=float,
        required=True,
        metavar="SECONDS",
        help="delete claims untouched for this long (required; never read from the "
        "environment, so that what a purge deletes is always typed)",
    )
    add_option(
        c_purge,
        "--status",
        choices=["completed", "failed"],
        shown="both",
        help="only claims in this status",
    )
    add_option(
        c_purge,
        "--scope",
        "--handler",
        metavar="SCOPE",
        shown="all scopes",
        help="only this handler's scope (app.handler), its tenants included",
    )
    c_purge.add_argument("--yes", action="store_true", help=YES_HELP)
    for p in (c_list, c_show, c_release, c_purge):
        add_common(p, broker=False)
    claims.set_defaults(handler=cmd_claims)


def add_conflicts(sub: Commands) -> None:
    conflicts = sub.add_parser(
        "conflicts",
        help="list key conflicts and settle them (discard, or run under a new key)",
        description="A message whose key was first used with another payload is never run: "
        "it is dead-lettered as key_conflict and recorded with both fingerprints and the paths "
        "that differ (values are never shown). Handlers and webhook sources with "
        "keep_payload=True keep both payloads, so that a conflict can be settled here: its "
        "second payload discarded, or run under a new key.",
    )
    actions = conflicts.add_subparsers(dest="conflicts_command", metavar="ACTION", required=True)
    x_list = actions.add_parser(
        "list",
        help="list unsettled conflicts, newest first",
        description="List recorded conflicts, newest first, with both fingerprints and what "
        "differs; settled ones too with --all.",
        epilog=EXIT_STATUS,
    )
    add_option(
        x_list,
        "--scope",
        "--handler",
        metavar="SCOPE",
        shown="all scopes",
        help="only this handler's (or webhook source's) scope, its tenants included",
    )
    add_option(x_list, "--all", action="store_true", default=False, help="settled conflicts too")
    add_option(x_list, "--limit", type=int, default=50, metavar="N", help="list at most this many")
    add_option(x_list, "--json", action="store_true", default=False, help="print JSON")
    x_settle = actions.add_parser(
        "settle",
        help="discard a conflict's second payload, or run it under a new key",
        description="Settle a conflict of SCOPE/KEY. --discard drops the second payload. "
        "--run-as NEW_KEY publishes it again, through the transactional outbox that every "
        "running worker relays (on either broker), with NEW_KEY as its key for this scope "
        "alone: the handler runs it once, the channel's other handlers see the duplicate it "
        "is for them. Needs the payload kept (keep_payload=True). Behind the webhook receiver "
        "the copy goes to the source's channel as the request would have with NEW_KEY. The "
        "first payload's claim is left as it is. Asks first unless --yes.",
        epilog=EXIT_STATUS,
    )
    x_settle.add_argument("scope", help=SCOPE_HELP)
    x_settle.add_argument("key", help=KEY_HELP)
    how = x_settle.add_mutually_exclusive_group(required=True)
    how.add_argument("--discard", action="store_true", help="drop the second payload")
    how.add_argument(
        "--run-as",
        metavar="NEW_KEY",
        help="run the second payload under this new key (one not claimed yet)",
    )
    x_settle.add_argument(
        "--id",
        type=int,
        dest="conflict_id",
        metavar="N",
        help="the conflict to settle when the key has several (`conflicts list` shows ids)",
    )
    x_settle.add_argument("--yes", action="store_true", help=YES_HELP)
    for p in (x_list, x_settle):
        add_common(p, broker=False)
    conflicts.set_defaults(handler=cmd_conflicts)


def add_dlq(sub: Commands) -> None:
    dlq = sub.add_parser(
        "dlq",
        help="look at and replay dead-lettered messages (RabbitMQ and Kafka)",
        description="A message its handler rejected, failed max_attempts times or could not "
        "decode is dead-lettered to <channel>.dlq (a queue on RabbitMQ, a topic on Kafka). "
        "List them with their reasons; replay them once the cause is fixed.",
    )
    actions = dlq.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    d_list = actions.add_parser(
        "list",
        help="show dead letters of a channel with their reasons",
        description="Show a channel's dead letters with their reason, scope and key, leaving "
        "them where they are.",
        epilog=EXIT_STATUS,
    )
    d_list.add_argument("channel", help=CHANNEL_HELP.format("are shown"))
    add_option(d_list, "--limit", type=int, default=100, metavar="N", help="show at most this many")
    add_option(d_list, "--json", action="store_true", default=False, help="print JSON")
    d_replay = actions.add_parser(
        "replay",
        help="move dead letters back to their channel and release their failed claims",
        description="Move a channel's dead letters back to the channel and release their "
        "failed claims, so that each runs once more. Asks first unless --yes.",
        epilog=EXIT_STATUS,
    )
    d_replay.add_argument("channel", help=CHANNEL_HELP.format("are moved back"))
    add_option(
        d_replay, "--limit", type=int, default=100, metavar="N", help="move at most this many"
    )
    d_replay.add_argument("--yes", action="store_true", help=YES_HELP)
    for p in (d_list, d_replay):
        add_common(p, broker=True)
    dlq.set_defaults(handler=cmd_dlq)
