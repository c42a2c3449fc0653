"""The `dedupe-worker` command: the one place that wires a transport to the core."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import pydantic

from .app import App
from .errors import ConfigurationError, DedupeError, StoreError
from .pipeline import Processor
from .settings import Settings
from .store import ClaimStore, connect_pool, migrate, redact
from .transport import Publisher, Transport

logger = logging.getLogger("dedupe.cli")
T = TypeVar("T")

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


class UsageError(DedupeError):
    """The command line asks for something that cannot be done."""


# -- option plumbing ----------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, *, broker: bool) -> None:
    parser.add_argument(
        "--database",
        dest="database_url",
        metavar="URL",
        help="PostgreSQL URL holding the claims [DEDUPE_DATABASE_URL; default: local dedupe db]",
    )
    if broker:
        parser.add_argument(
            "--broker",
            dest="broker_url",
            metavar="URL",
            help="amqp://user:pass@host:port/vhost (RabbitMQ) or kafka://host:port "
            "[DEDUPE_BROKER_URL; default: local RabbitMQ]",
        )
    parser.add_argument(
        "--log-level",
        dest="log_level",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR [DEDUPE_LOG_LEVEL; default: INFO]",
    )


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {
        name: value
        for name, value in vars(args).items()
        if name in Settings.model_fields and value is not None
    }
    try:
        return Settings(**overrides)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise UsageError(f"invalid configuration: {problems}") from exc


def load_app(target: str, *, need: str = "handlers") -> App:
    """Import `module:attribute` and check it is an App with handlers (or webhooks)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"{target!r}: expected MODULE:APP, for example handlers.payments:app")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like python -m: the current directory is importable
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"cannot import module {module_name!r} ({exc}); run from your project's root or "
            "add it to PYTHONPATH"
        ) from exc
    app = getattr(module, attribute, None)
    if not isinstance(app, App):
        raise UsageError(
            f"{module_name!r} has no dedupe App named {attribute!r}; define one with "
            "app = dedupe.App('name')"
        )
    if need == "webhooks":
        if not app.webhooks:
            raise UsageError(
                f"app {app.name!r} declares no webhook sources; add one with app.webhook(...)"
            )
        return app
    if not app.handlers:
        raise UsageError(f"app {app.name!r} has no handlers; register one with @app.handler(...)")
    return app


def make_transport(settings: Settings, *, app_name: str | None = None) -> Transport:
    """Pick the transport from the broker URL's scheme (Kafka names its group after the app)."""
    if settings.broker_url.startswith("kafka://"):
        try:
            from consumers.kafka import KafkaTransport  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise UsageError(f"the Kafka transport is not available: {exc}") from exc
        transport: Transport = KafkaTransport(
            settings.broker_url, settings=settings, app_name=app_name
        )
        return transport
    from consumers.rabbitmq import RabbitMQTransport

    return RabbitMQTransport(
        settings.broker_url,
        prefetch=settings.effective_prefetch,
        batch_max=settings.effective_prefetch,
        connection_name=f"dedupe-worker {settings.worker_name}",
    )


def make_publisher(settings: Settings) -> Publisher:
    """Pick the publisher (confirmed publishes, for the webhook receiver) from the broker URL."""
    if settings.broker_url.startswith("kafka://"):
        try:
            from consumers.kafka import (  # type: ignore[import-not-found,attr-defined,unused-ignore]
                KafkaPublisher,
            )
        except ImportError as exc:
            raise UsageError(
                f"publishing to Kafka needs consumers.kafka.KafkaPublisher, which is not "
                f"available in this install ({exc}); use an amqp:// broker for now"
            ) from exc
        publisher: Publisher = KafkaPublisher(settings.broker_url)
        return publisher
    from consumers.rabbitmq import RabbitMQPublisher

    return RabbitMQPublisher(settings.broker_url)


# -- commands ------------------------------------------------------------------------------


async def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    app = load_app(args.app)
    transport = make_transport(settings, app_name=app.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            logger.info(
                "%s received: finishing in-flight messages (up to %gs); send it again to "
                "stop at once",
                signal.Signals(signum).name,
                settings.shutdown_timeout_s,
            )
            stop.set()
        else:
            logger.warning("second signal: giving in-flight messages back now")
            drain_now.set()

    drain_now = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    pool = await _retrying(
        "PostgreSQL",
        lambda: connect_pool(settings.database_url, max_size=settings.concurrency + 4),
        settings.connect_timeout_s,
    )
    async with pool:
        store = ClaimStore(pool, owner=settings.worker_name)
        await _check_migrated(store)
        async with Processor(
            app,
            store,
            concurrency=settings.concurrency,
            gc_interval_s=settings.gc_interval_s or None,
        ) as processor:
            await _connect_broker(transport, settings)
            logger.info(
                "worker %s running app %r: %s",
                settings.worker_name,
                app.name,
                ", ".join(
                    f"{h.name} <- {h.channel} (key={h.key_spec})" for h in app.handlers.values()
                ),
            )
            serving = asyncio.create_task(
                transport.serve(list(app.channels), processor.process, stop), name="serve"
            )
            reporter = asyncio.create_task(_report(processor, settings.stats_interval_s))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if serving.done() and not stop.is_set():
                stop.set()
                serving.result()  # the transport failed: raise its error
            drain = asyncio.create_task(processor.drain(timeout_s=settings.shutdown_timeout_s))
            forced = asyncio.create_task(drain_now.wait())
            await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
            if not drain.done():
                drain.cancel()
                await processor.drain(timeout_s=0)
            forced.cancel()
            await serving
            reporter.cancel()
            await transport.close()
    logger.info("stopped; %s", json.dumps(processor.stats.snapshot()))
    return 0


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
    pool = await _retrying(
        "PostgreSQL",
        lambda: connect_pool(settings.database_url, max_size=args.pool_size),
        settings.connect_timeout_s,
    )
    async with pool:
        store = ClaimStore(pool, owner=settings.worker_name)
        await _check_migrated(store)
        asgi = create_receiver(
            app, store=store, publisher=lambda: publisher, owner=settings.worker_name
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


async def _retrying(what: str, connect: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """Connect, retrying with backoff for up to timeout_s: services may start after us."""
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while True:
        try:
            return await connect()
        except (OSError, DedupeError, ConnectionError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            logger.warning("%s not reachable yet (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _connect_broker(transport: Transport, settings: Settings) -> None:
    connect: Callable[[], Awaitable[None]] | None = getattr(transport, "connect", None)
    if connect is None:
        return

    async def attempt() -> None:
        assert connect is not None
        try:
            await connect()
        except Exception as exc:
            raise DedupeError(
                f"cannot reach the broker at {redact(settings.broker_url)}: {exc}. Is it "
                "running (`make services`)? Set the URL with --broker or DEDUPE_BROKER_URL."
            ) from exc

    await _retrying("broker", attempt, settings.connect_timeout_s)


async def _check_migrated(store: ClaimStore) -> None:
    present = await store.pool.fetchval("SELECT to_regclass('dedupe_claims') IS NOT NULL")
    if not present:
        raise ConfigurationError(
            "the claims table does not exist in this database; run `dedupe-worker migrate` first"
        )


async def _report(processor: Processor, interval_s: float) -> None:
    if interval_s <= 0:
        return
    last: dict[str, Any] = {}
    while True:
        await asyncio.sleep(interval_s)
        snapshot = processor.stats.snapshot()
        if snapshot != last:
            logger.info("progress: %s in flight, %s", processor.in_flight, json.dumps(snapshot))
            last = snapshot


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


def _print_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    table = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col), *(len(r[i]) for r in table)]) for i, col in enumerate(columns)]
    print("  ".join(col.upper().ljust(w) for col, w in zip(columns, widths, strict=True)))
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if hasattr(value, "isoformat"):
        return str(value.isoformat(timespec="seconds"))
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
                _print_rows(rows, ["scope", "key", "status", "attempts", "age_s", "owner", "error"])
            else:
                print("no claims match")
            return 0
        if args.claims_command == "show":
            row = await store.show_claim(args.scope, args.key)
            if row is None:
                print(f"no claim for scope {args.scope!r} key {args.key!r}", file=sys.stderr)
                return 1
            print(json.dumps(row, default=str, indent=2))
            return 0
        # release
        if not args.yes and not _confirm(
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


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise UsageError(f"{question} -- not a terminal: pass --yes to confirm")
    return input(f"{question} [y/N] ").strip().lower() in {"y", "yes"}


async def cmd_dlq(args: argparse.Namespace, settings: Settings) -> int:
    if not settings.broker_url.startswith(("amqp://", "amqps://")):
        raise UsageError("dlq list|replay supports RabbitMQ brokers (amqp://...) for now")
    from consumers import rabbitmq

    if args.dlq_command == "list":
        rows = await rabbitmq.peek_dead_letters(settings.broker_url, args.channel, limit=args.limit)
        if args.json:
            print(json.dumps(rows, indent=2))
        elif rows:
            _print_rows(rows, ["message_id", "reason", "scope", "key", "detail"])
        else:
            print(f"{args.channel}.dlq is empty")
        return 0
    if not args.yes and not _confirm(
        f"move up to {args.limit} dead letters back to {args.channel}?"
    ):
        print("nothing done")
        return 1
    released: list[str] = []
    async with ClaimStore.open(settings.database_url, owner="admin") as store:

        async def release(scope: str, key: str) -> None:
            if await store.release(scope, key):
                released.append(key)

        moved = await rabbitmq.replay_dead_letters(
            settings.broker_url, args.channel, limit=args.limit, release=release
        )
    print(
        f"replayed {len(moved)} dead letter(s) to {args.channel}; released {len(released)} "
        "failed claim(s) so they run again"
    )
    return 0


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
    _common(run, broker=True)
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
    _common(receive, broker=True)
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
    _common(mig, broker=False)
    mig.set_defaults(handler=cmd_migrate)

    gc = sub.add_parser("gc", help="delete expired claims now (workers also do it periodically)")
    _common(gc, broker=False)
    gc.add_argument("--batch-size", type=int, default=1000, help="rows per DELETE (default 1000)")
    gc.add_argument("--max-batches", type=int, default=1000, help="stop after this many batches")
    gc.set_defaults(handler=cmd_gc)

    claims = sub.add_parser("claims", help="inspect and release idempotency keys")
    claims_sub = claims.add_subparsers(dest="claims_command", metavar="ACTION", required=True)
    c_list = claims_sub.add_parser("list", help="list claims, newest first")
    c_list.add_argument("--scope", help="a handler's scope (app.handler), tenants included")
    c_list.add_argument("--status", choices=["in_progress", "completed", "failed"])
    c_list.add_argument("--older-than-s", type=float, help="only claims created this long ago")
    c_list.add_argument("--limit", type=int, default=50)
    c_list.add_argument("--json", action="store_true", help="print JSON")
    c_show = claims_sub.add_parser("show", help="show one claim")
    c_rel = claims_sub.add_parser(
        "release", help="let a stuck or failed key run again (never a completed one)"
    )
    for p in (c_show, c_rel):
        p.add_argument("scope", help="e.g. shop.charge")
        p.add_argument("key")
    c_rel.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    for p in (c_list, c_show, c_rel):
        _common(p, broker=False)
    claims.set_defaults(handler=cmd_claims)

    dlq = sub.add_parser("dlq", help="look at and replay dead-lettered messages (RabbitMQ)")
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
        _common(p, broker=True)
    dlq.set_defaults(handler=cmd_dlq)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = _settings(args)
    except UsageError as exc:
        parser.exit(2, f"dedupe-worker: error: {exc}\n")
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("aiormq", "aio_pika", "aiokafka"):
        # At DEBUG the broker clients log whole frames, bodies included: never a payload in logs.
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))
    try:
        with contextlib.suppress(KeyboardInterrupt):
            return int(asyncio.run(args.handler(args, settings)))
        return 130
    except (DedupeError, StoreError) as exc:
        print(f"dedupe-worker: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
