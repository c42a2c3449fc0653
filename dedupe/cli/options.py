"""What every command shares: options, settings, loading the app, picking the transport."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pydantic

from ..app import App
from ..errors import ConfigurationError, DedupeError
from ..settings import Settings
from ..store import ClaimStore
from ..transport import Publisher, Transport

logger = logging.getLogger("dedupe.cli")
T = TypeVar("T")


class UsageError(DedupeError):
    """The command line asks for something that cannot be done."""


def add_common(parser: argparse.ArgumentParser, *, broker: bool) -> None:
    """The options of every command: database, broker (where it needs one), logging."""
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
    parser.add_argument(
        "--log-format",
        dest="log_format",
        choices=["text", "json"],
        help="text for people, json (one object per line) for machines "
        "[DEDUPE_LOG_FORMAT; default: text]",
    )
    parser.add_argument(
        "--event-loop",
        dest="event_loop",
        choices=["auto", "uvloop", "asyncio"],
        help="auto: uvloop when it is installed (pip install 'dedupe-worker[uvloop]'; "
        "1.1-1.2x the messages per second of a worker in our benchmarks), else asyncio's own "
        "[DEDUPE_EVENT_LOOP; default: auto]",
    )


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by the options given on the command line."""
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


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to run a command on: uvloop where asked for or, on auto, installed."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise UsageError(
                "--event-loop uvloop: uvloop is not installed; pip install 'dedupe-worker[uvloop]'"
            ) from exc
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


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


async def retrying(what: str, connect: Callable[[], Awaitable[T]], timeout_s: float) -> T:
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


async def check_migrated(store: ClaimStore) -> None:
    present = await store.pool.fetchval("SELECT to_regclass('dedupe_claims') IS NOT NULL")
    if not present:
        raise ConfigurationError(
            "the claims table does not exist in this database; run `dedupe-worker migrate` first"
        )


def confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise UsageError(f"{question} -- not a terminal: pass --yes to confirm")
    return input(f"{question} [y/N] ").strip().lower() in {"y", "yes"}


def print_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    table = [[cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col), *(len(r[i]) for r in table)]) for i, col in enumerate(columns)]
    print("  ".join(col.upper().ljust(w) for col, w in zip(columns, widths, strict=True)))
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if hasattr(value, "isoformat"):
        return str(value.isoformat(timespec="seconds"))
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
