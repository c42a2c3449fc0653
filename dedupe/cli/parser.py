"""The `dedupe-worker` command line: each command's options and help (operators': parser_admin)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dedupe.cli.options import add_common, add_option, positive_float, positive_int
from dedupe.cli.parser_admin import add_claims, add_conflicts, add_dlq, add_gc, add_migrate
from dedupe.cli.receive import cmd_receive
from dedupe.cli.run import cmd_run
from dedupe.cli.status import cmd_status

if TYPE_CHECKING:
    from dedupe.cli.parser_admin import Commands

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
--older-than-s, conflicts settle --discard, conflicts settle --run-as, conflicts settle --id
and the positional arguments; the command line wins. Each option's help
names its variable: --database is DEDUPE_DATABASE_URL, --concurrency is DEDUPE_CONCURRENCY,
gc --batch-size is DEDUPE_GC_BATCH_SIZE, claims list --limit is DEDUPE_CLAIMS_LIST_LIMIT.
docs/configuration.md lists them all.
"""

EXIT_STATUS_SERVING = (
    "exit status: 0 on success and after a stop by SIGTERM or SIGINT, 1 when the command "
    "could not do what was asked (its message says why and what to do), 2 on a bad option or "
    "environment variable."
)
APP_HELP = (
    "the app: MODULE is imported from the current directory (or PYTHONPATH), APP is the "
    "dedupe.App in it, e.g. {}"
)


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
    add_migrate(sub)
    add_gc(sub)
    add_claims(sub)
    add_conflicts(sub)
    _add_status(sub)
    add_dlq(sub)
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
        "[DEDUPE_PREFETCH; 8 x concurrency]",
    )
    _add_process_options(run, stop="in-flight messages finish", connect="PostgreSQL and the broker")
    run.add_argument(
        "--gc-interval-s",
        type=float,
        metavar="SECONDS",
        help="period of the clean-up of expired claims, 0 = off [DEDUPE_GC_INTERVAL_S; 300]",
    )
    run.add_argument(
        "--park-after-s",
        type=float,
        metavar="SECONDS",
        help="a retry waiting at least this long goes through the broker, the key given back; "
        "a shorter one waits in the worker [DEDUPE_PARK_AFTER_S; 5]",
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
        "--http",
        choices=["h11", "httptools"],
        default="h11",
        help="uvicorn's HTTP/1.1 parser: h11 bounds a request's head (an unfinished head past "
        "16 KiB gets 400); httptools is faster but keeps any head a client sends, so use it "
        "only behind a proxy that bounds heads",
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
