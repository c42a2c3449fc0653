"""Transports and servers plug in by entry point: the core finds a broker's by its URL's scheme.

A broker package (ours in `consumers/`, or a third party's: NATS, Redis Streams, SQS) registers
a `TransportPlugin` in its `pyproject.toml`::

    [project.entry-points."dedupe.transports"]
    amqp = "dedupe_rabbitmq.plugin:plugin"

and the HTTP servers the CLI starts (`receive`, `status --serve`) register a `Server` under
`dedupe.servers`. Nothing in `dedupe/` imports a broker client or an HTTP library.
docs/transports.md says how to write one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import TYPE_CHECKING, Any, Protocol

from dedupe.errors import ConfigurationError
from dedupe.operations.replay import Release
from dedupe.registry import SERVERS, TRANSPORTS, registered, scheme_of
from dedupe.transport import Publisher, Transport

if TYPE_CHECKING:
    from dedupe.app import App
    from dedupe.claims.store import ClaimStore
    from dedupe.settings import Settings


# (body, headers, message_id) triples, as `dlq replay` and the tests publish them.
Messages = Sequence[tuple[bytes, Mapping[str, Any], str | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class UrlOption:
    """One `?name=value` option a transport's URLs take, as docs/configuration.md lists it."""

    name: str
    type: str  # int, float, str
    default: str
    run_default: str  # the default `dedupe-worker run` gives it instead, or "the same"
    meaning: str


class BrokerAdmin(Protocol):
    """What the operator commands (`dlq list|replay`) and tests ask of a broker."""

    async def peek_dead_letters(self, channel: str, *, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` dead letters (message_id, reason, detail, scope, key), left in place."""
        ...

    async def replay_dead_letters(
        self, channel: str, *, limit: int, release: Release | None = None
    ) -> list[dict[str, Any]]:
        """Move up to `limit` dead letters back to the channel (dedupe.operations.replay says
        how)."""
        ...

    async def publish(self, channel: str, messages: Messages) -> int:
        """Publish with confirms (declaring the channel first); return how many."""
        ...

    async def delete_channels(self, channels: Sequence[str]) -> int:
        """Delete the channels' queues or topics with whatever they hold."""
        ...


class TransportPlugin(Protocol):
    """A broker's entry point: its transport, publisher and admin client for one URL."""

    name: str  # shown to people: "RabbitMQ", "Kafka"
    # Errors that mean "the broker is not reachable" (the CLI says where and what to do).
    unreachable: tuple[type[BaseException], ...]
    # Whether the dead-letter queue is a log that replay leaves in place (Kafka) or a queue.
    dead_letters_kept: bool

    def transport(self, settings: Settings, *, app_name: str | None = None) -> Transport:
        """A consumer for `settings.broker_url`."""
        ...

    def publisher(self, settings: Settings) -> Publisher:
        """A confirming publisher for `settings.broker_url` (the webhook receiver's)."""
        ...

    def admin(self, url: str) -> BrokerAdmin:
        """The operator's client for `url`."""
        ...

    def url_options(self) -> Sequence[UrlOption]:
        """The `?name=value` options its URLs take (none: an empty sequence)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Serving:
    """What the CLI hands an HTTP server: what to serve, and when to stop.

    The CLI installs the signal handlers (in one place) and sets the events; the server only
    watches them. Where it listens is in `settings` (receiver_host/port, status_host/port).
    """

    settings: Settings
    store: ClaimStore  # open and migrated; the CLI closes it
    stop: asyncio.Event  # first SIGTERM/SIGINT: finish open requests, then return
    force: asyncio.Event  # a second signal: close open connections now
    # The webhook receiver's (`dedupe-worker receive`):
    app: App | None = None
    publisher: Publisher | None = None  # opened and closed by the server
    store_timeout_s: float = 3.0
    http: str = "h11"  # uvicorn's HTTP/1.1 protocol: h11 or httptools (`receive --http`)
    serve_status: bool = True
    serve_metrics: bool = True


# An HTTP server the CLI runs until `stop` is set: the webhook receiver, the status page. It
# returns whether it served (False: it could not start, e.g. the port is taken).
Server = Callable[[Serving], Awaitable[bool]]


def transport_plugin(url: str) -> TransportPlugin:
    """The plugin registered for the URL's scheme; ConfigurationError says what to install."""
    scheme = scheme_of(url)
    found = registered(TRANSPORTS)
    entry = found.get(scheme)
    if entry is None:
        known = ", ".join(f"{name}://" for name in sorted(found)) or "none"
        raise ConfigurationError(
            f"no transport is installed for {scheme or url!r} URLs (installed: {known}); "
            "install the broker's package, e.g. pip install 'dedupe-worker[rabbitmq]' or "
            "'dedupe-worker[kafka]'"
        )
    return _load(entry, f"the {scheme}:// transport")  # type: ignore[no-any-return]


def server(name: str) -> Server:
    """The HTTP server registered as `name` (receiver, status)."""
    entry = registered(SERVERS).get(name)
    if entry is None:
        raise ConfigurationError(
            f"the {name} server is not installed: pip install 'dedupe-worker[receiver]'"
        )
    return _load(entry, f"the {name} server")  # type: ignore[no-any-return]


def _load(entry: EntryPoint, what: str) -> Any:
    try:
        return entry.load()
    except ImportError as exc:
        raise ConfigurationError(
            f"{what} ({entry.value}) cannot be loaded: {exc}. Install its extra, e.g. "
            "pip install 'dedupe-worker[rabbitmq,kafka,receiver]'"
        ) from exc


__all__ = [
    "BrokerAdmin",
    "Messages",
    "Server",
    "Serving",
    "TransportPlugin",
    "UrlOption",
    "server",
    "transport_plugin",
]
