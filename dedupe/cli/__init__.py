"""The `dedupe-worker` command: the one place that wires a transport to the core.

The parser and main() live here; each command lives in its own module (run, receive, admin).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence

from .. import logs
from ..errors import DedupeError, StoreError
from .admin import cmd_claims, cmd_dlq, cmd_gc, cmd_migrate
from .options import (
    UsageError,
    add_common,
    load_app,
    loop_factory,
    make_publisher,
    make_transport,
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

Every option can also be set in the environment: --database is DEDUPE_DATABASE_URL,
--broker is DEDUPE_BROKER_URL, --concurrency is DEDUPE_CONCURRENCY, and so on.
"""


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="dedupe-worker", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="consume messages and run the app's handlers",
        formatter_class=fmt,
        description="Consume every channel the app's handlers listen on. SIGTERM or SIGINT "
        "stops taking messages and lets in-flight ones finish (--shutdown-timeout-s); a second "
        "signal gives them back to the broker at once.",
    )
    run.add_argument("app", metavar="MODULE:APP", help="e.g. handlers.payments:app")
    add_common(run, broker=True)
    run.add_argument(
        "--concurrency", type=int, help="handlers running at once [DEDUPE_CONCURRENCY; 32]"
    )
    run.add_argument(
        "--prefetch",
        type=int,
        help="unacknowledged deliveries held [DEDUPE_PREFETCH; 2 x concurrency]",
    )
    run.add_argument(
        "--shutdown-timeout-s",
        type=float,
        help="grace period on SIGTERM [DEDUPE_SHUTDOWN_TIMEOUT_S; 30]",
    )
    run.add_argument(
        "--gc-interval-s", type=float, help="clean-up period, 0 = off [DEDUPE_GC_INTERVAL_S; 300]"
    )
    run.add_argument("--worker-name", help="owner written on claims [DEDUPE_WORKER_NAME; host:pid]")
    run.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port, 0 = off [DEDUPE_METRICS_PORT; 0]",
    )
    run.add_argument(
        "--metrics-host",
        help="address of the metrics endpoint [DEDUPE_METRICS_HOST; 127.0.0.1]",
    )
    run.set_defaults(handler=cmd_run)

    receive = sub.add_parser(
        "receive",
        help="serve the app's webhook sources over HTTP (POST /webhooks/<source>)",
        formatter_class=fmt,
        description="Verify webhook signatures, claim each delivery's idempotency key, publish "
        "it to its channel with confirms and store the reply, so that a provider's retries "
        "are answered with the same reply and published once. SIGTERM or SIGINT finishes "
        "open requests; a second signal closes them.",
    )
    receive.add_argument("app", metavar="MODULE:APP", help="e.g. handlers.webhooks:app")
    add_common(receive, broker=True)
    receive.add_argument(
        "--host",
        dest="receiver_host",
        help="address to listen on [DEDUPE_RECEIVER_HOST; 127.0.0.1]",
    )
    receive.add_argument(
        "--port", dest="receiver_port", type=int, help="port [DEDUPE_RECEIVER_PORT; 8080]"
    )
    receive.add_argument(
        "--pool-size", type=int, default=20, help="PostgreSQL connections (default 20)"
    )
    receive.set_defaults(handler=cmd_receive)

    mig = sub.add_parser("migrate", help="create or update the claims table")
    add_common(mig, broker=False)
    mig.set_defaults(handler=cmd_migrate)

    gc = sub.add_parser("gc", help="delete expired claims now (workers also do it periodically)")
    add_common(gc, broker=False)
    gc.add_argument("--batch-size", type=int, default=1000, help="rows per DELETE (default 1000)")
    gc.add_argument("--max-batches", type=int, default=1000, help="stop after this many batches")
    gc.set_defaults(handler=cmd_gc)

    claims = sub.add_parser("claims", help="inspect and release idempotency keys")
    claims_sub = claims.add_subparsers(dest="claims_command", metavar="ACTION", required=True)
    c_list = claims_sub.add_parser("list", help="list claims, newest first")
    c_list.add_argument(
        "--scope", "--handler", help="a handler's scope (app.handler), tenants included"
    )
    c_list.add_argument("--status", choices=["in_progress", "completed", "failed"])
    c_list.add_argument("--older-than-s", type=float, help="only claims created this long ago")
    c_list.add_argument("--limit", type=int, default=50)
    c_list.add_argument("--json", action="store_true", help="print JSON")
    c_show = claims_sub.add_parser("show", help="show one claim with its history")
    c_show.add_argument(
        "--table", action="store_true", help="print a table for people instead of JSON"
    )
    c_rel = claims_sub.add_parser(
        "release", help="let a stuck or failed key run again (never a completed one)"
    )
    for p in (c_show, c_rel):
        p.add_argument("scope", help="e.g. shop.charge")
        p.add_argument("key")
    c_rel.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    c_purge = claims_sub.add_parser(
        "purge", help="delete finished claims older than an age (never in-progress ones)"
    )
    c_purge.add_argument(
        "--older-than-s", type=float, required=True, help="untouched for this long (seconds)"
    )
    c_purge.add_argument("--status", choices=["completed", "failed"], help="default: both")
    c_purge.add_argument("--scope", "--handler", help="only this scope (tenants included)")
    c_purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    for p in (c_list, c_show, c_rel, c_purge):
        add_common(p, broker=False)
    claims.set_defaults(handler=cmd_claims)

    status = sub.add_parser(
        "status",
        help="claims per handler, stuck keys, recent conflicts and dead letters",
        formatter_class=fmt,
        description="Print the claims at a glance, or serve them as the status page "
        "(--serve), where an operator can release a stuck key. Releasing from the page needs "
        "DEDUPE_STATUS_TOKEN (open /status?token=...) or, without a token, a loopback client.",
    )
    add_common(status, broker=False)
    status.add_argument(
        "--stuck-after-s", type=float, default=60.0, help="in progress this long is stuck (60)"
    )
    status.add_argument("--limit", type=int, default=20, help="recent events shown (20)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--serve", action="store_true", help="serve the status page over HTTP")
    status.add_argument(
        "--host", dest="status_host", help="address to listen on [DEDUPE_STATUS_HOST; 127.0.0.1]"
    )
    status.add_argument(
        "--port", dest="status_port", type=int, help="port [DEDUPE_STATUS_PORT; 8081]"
    )
    status.set_defaults(handler=cmd_status)

    dlq = sub.add_parser(
        "dlq", help="look at and replay dead-lettered messages (RabbitMQ and Kafka)"
    )
    dlq_sub = dlq.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    d_list = dlq_sub.add_parser("list", help="show dead letters of a channel with their reasons")
    d_list.add_argument("--json", action="store_true", help="print JSON")
    d_replay = dlq_sub.add_parser(
        "replay", help="move dead letters back to their channel and release their failed claims"
    )
    d_replay.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    for p in (d_list, d_replay):
        p.add_argument("channel")
        p.add_argument("--limit", type=int, default=100)
        add_common(p, broker=True)
    dlq.set_defaults(handler=cmd_dlq)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
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
