"""The `dedupe-worker` command: the one place that wires a transport to the core.

The parser and main() live here; each command lives in its own module (run, receive, admin).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

from .. import logs
from ..errors import DedupeError, StoreError
from .admin import cmd_claims, cmd_dlq, cmd_gc, cmd_migrate
from .options import (
    UsageError,
    add_common,
    add_option,
    load_app,
    loop_factory,
    make_publisher,
    make_transport,
    positive_float,
    positive_int,
    read_environment,
    settings_from,
)
from .receive import cmd_receive
from .run import cmd_run
from .status import cmd_status

DESCRIPTION = """\
Run message handlers that are safe to retry.

Each message's idempotency key is claimed in PostgreSQL before its handler runs, and the
outcome is recorded together with the handler's ctx.db writes, so a redelivered, duplicated
or crash-restarted message is acknowledged without repeating its effects.
"""

EPILOG = """\
quick start:
  dedupe-worker migrate
  dedupe-worker run handlers.payments:app --broker amqp://guest:guest@127.0.0.1:5672/
  dedupe-worker claims list --status in_progress
  dedupe-worker dlq list payments

Every option can also be set in the environment, except --help, --yes, claims purge
--older-than-s and the positional arguments; the command line wins. Each option's help
names its variable: --database is DEDUPE_DATABASE_URL, --concurrency is DEDUPE_CONCURRENCY,
gc --batch-size is DEDUPE_GC_BATCH_SIZE, claims list --limit is DEDUPE_CLAIMS_LIST_LIMIT.
docs/configuration.md lists them all.
"""

EXIT_STATUS = (
    "exit status: 0 on success, 1 when the command could not do what was asked (its message "
    "says why and what to do), 2 on a bad option or environment variable."
)
EXIT_STATUS_SERVING = (
    "exit status: 0 on success and after a stop by SIGTERM or SIGINT, 1 when the command "
    "could not do what was asked (its message says why and what to do), 2 on a bad option or "
    "environment variable."
)
APP_HELP = (
    "the app: MODULE is imported from the current directory (or PYTHONPATH), APP is the "
    "dedupe.App in it, e.g. {}"
)
SCOPE_HELP = "the handler's scope as `claims list` shows it, e.g. shop.charge"
KEY_HELP = "the idempotency key, e.g. pay-42"
CHANNEL_HELP = "the handler's channel (queue or topic) whose dead letters, in <channel>.dlq, {}"
YES_HELP = "do not ask for confirmation (needed without a terminal)"
if TYPE_CHECKING:
    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedupe-worker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run(sub)
    _add_receive(sub)
    _add_migrate(sub)
    _add_gc(sub)
    _add_claims(sub)
    _add_status(sub)
    _add_dlq(sub)
    return parser


def _add_run(sub: Commands) -> None:
    run = sub.add_parser(
        "run",
        help="consume messages and run the app's handlers",
        description="Consume every channel the app's handlers listen on; each message's "
        "idempotency key is claimed before its handler runs. SIGTERM or SIGINT stops taking "
        "messages and lets in-flight ones finish for up to --shutdown-timeout-s; what still "
        "runs then is cancelled, its key released and its message given back to the broker. "
        "A second signal does that at once.",
        epilog=EXIT_STATUS_SERVING,
    )
    run.add_argument("app", metavar="MODULE:APP", help=APP_HELP.format("handlers.payments:app"))
    add_common(run, broker=True)
    run.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="handlers running at once [DEDUPE_CONCURRENCY; 32]",
    )
    run.add_argument(
        "--prefetch",
        type=int,
        metavar="N",
        help="unacknowledged deliveries held (RabbitMQ prefetch, Kafka batch) "
        "[DEDUPE_PREFETCH; 2 x concurrency]",
    )
    _add_process_options(run, stop="in-flight messages finish", connect="PostgreSQL and the broker")
    run.add_argument(
        "--gc-interval-s",
        type=float,
        metavar="SECONDS",
        help="period of the clean-up of expired claims, 0 = off [DEDUPE_GC_INTERVAL_S; 300]",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port, 0 = off [DEDUPE_METRICS_PORT; 0]",
    )
    run.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="address of the metrics endpoint [DEDUPE_METRICS_HOST; 127.0.0.1]",
    )
    run.set_defaults(handler=cmd_run)


def _add_process_options(parser: argparse.ArgumentParser, *, stop: str, connect: str) -> None:
    """The options of the long-running commands: start, stop and name."""
    parser.add_argument(
        "--shutdown-timeout-s",
        type=float,
        metavar="SECONDS",
        help=f"on SIGTERM or SIGINT, how long to let {stop} [DEDUPE_SHUTDOWN_TIMEOUT_S; 30]",
    )
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        metavar="SECONDS",
        help=f"how long to keep retrying {connect} at start [DEDUPE_CONNECT_TIMEOUT_S; 60]",
    )
    parser.add_argument(
        "--worker-name",
        metavar="NAME",
        help="owner written on claims [DEDUPE_WORKER_NAME; host:pid]",
    )


def _add_receive(sub: Commands) -> None:
    receive = sub.add_parser(
        "receive",
        help="serve the app's webhook sources over HTTP (POST /webhooks/<source>)",
        description="Verify webhook signatures, claim each delivery's idempotency key, publish "
        "it to its channel with confirms and store the reply, so that a provider's retries "
        "are answered with the same reply and published once. SIGTERM or SIGINT finishes "
        "open requests; a second signal closes them.",
        epilog=EXIT_STATUS_SERVING,
    )
    receive.add_argument("app", metavar="MODULE:APP", help=APP_HELP.format("handlers.webhooks:app"))
    add_common(receive, broker=True)
    receive.add_argument(
        "--host",
        dest="receiver_host",
        metavar="HOST",
        help="address to listen on [DEDUPE_RECEIVER_HOST; 127.0.0.1]",
    )
    receive.add_argument(
        "--port",
        dest="receiver_port",
        type=int,
        metavar="PORT",
        help="port to listen on [DEDUPE_RECEIVER_PORT; 8080]",
    )
    add_option(
        receive,
        "--pool-size",
        type=positive_int,
        default=20,
        metavar="N",
        help="PostgreSQL connections of the receiver",
    )
    add_option(
        receive,
        "--store-timeout-s",
        type=positive_float,
        default=3.0,
        metavar="S",
        help="longest wait for one claims-table statement in a request; past it the sender "
        "gets 503 with Retry-After",
    )
    add_option(
        receive,
        "--no-status",
        action="store_true",
        default=False,
        help="do not serve the status page (/status) on the webhook port (it is for operators: "
        "loopback clients, or others with the token of DEDUPE_STATUS_TOKEN)",
    )
    add_option(
        receive,
        "--no-metrics",
        action="store_true",
        default=False,
        help="do not serve /metrics on the webhook port",
    )
    _add_process_options(receive, stop="open requests finish", connect="PostgreSQL")
    receive.set_defaults(handler=cmd_receive)


def _add_migrate(sub: Commands) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="create or update the tables dedupe-worker keeps in PostgreSQL",
        description="Create the tables dedupe-worker keeps in PostgreSQL (claims, their history, "
        "dead letters), or bring them up to date after an upgrade. Only the migrations not "
        "applied yet run, under a lock: it is safe to run again, and from several processes "
        "at once. Run it before the first worker starts.",
        epilog=EXIT_STATUS,
    )
    add_common(migrate, broker=False)
    migrate.set_defaults(handler=cmd_migrate)


def _add_gc(sub: Commands) -> None:
    gc = sub.add_parser(
        "gc",
        help="delete expired claims now (workers also do it periodically)",
        description="Delete the claims whose retention (the handler's retention_s) has passed. "
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


def _add_claims(sub: Commands) -> None:
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
        help="show one claim with its history",
        description="Show one claim (status, attempts, owner, outcome, trace id) with its "
        "history of take-overs, retries, failures and releases, as JSON.",
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


def _add_status(sub: Commands) -> None:
    status = sub.add_parser(
        "status",
        help="claims per handler, stuck keys, recent conflicts and dead letters",
        description="Print the claims at a glance, or serve them as the status page "
        "(--serve), where an operator can release a stuck key. Releasing from the page needs "
        "DEDUPE_STATUS_TOKEN (open /status?token=...) or, without a token, a loopback client.",
        epilog=EXIT_STATUS_SERVING,
    )
    add_common(status, broker=False)
    add_option(
        status,
        "--stuck-after-s",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="an in-progress claim this old counts as stuck",
    )
    add_option(
        status,
        "--limit",
        type=int,
        default=20,
        metavar="N",
        help="recent conflicts and dead letters shown",
    )
    add_option(status, "--json", action="store_true", default=False, help="print JSON")
    add_option(
        status,
        "--serve",
        action="store_true",
        default=False,
        help="serve the status page over HTTP instead of printing",
    )
    status.add_argument(
        "--host",
        dest="status_host",
        metavar="HOST",
        help="address to listen on with --serve [DEDUPE_STATUS_HOST; 127.0.0.1]",
    )
    status.add_argument(
        "--port",
        dest="status_port",
        type=int,
        metavar="PORT",
        help="port to listen on with --serve [DEDUPE_STATUS_PORT; 8081]",
    )
    status.set_defaults(handler=cmd_status)


def _add_dlq(sub: Commands) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        read_environment(parser, args, os.environ)
        settings = settings_from(args)
    except UsageError as exc:
        parser.exit(2, f"dedupe-worker: error: {exc}\n")
    logs.configure(settings.log_level, settings.log_format)
    try:
        with (
            contextlib.suppress(KeyboardInterrupt),
            asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner,
        ):
            return int(runner.run(args.handler(args, settings)))
        return 130
    except (DedupeError, StoreError) as exc:
        print(f"dedupe-worker: error: {exc}", file=sys.stderr)
        return 1


__all__ = ["UsageError", "build_parser", "load_app", "main", "make_publisher", "make_transport"]
