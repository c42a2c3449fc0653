"""The RabbitMQ transport's broker URL: the nodes it lists and the options it takes.

`amqp://user:pass@node1:5672,node2:5672,node3:5672/vhost?queue_type=quorum&heartbeat=30`:
the nodes are tried in the order written (dedupe_rabbitmq.connection), each as
`amqp://user:pass@nodeN/vhost?heartbeat=30`; the options this package reads (`queue_type`) are
taken out of the query, and what is left (`heartbeat=`, `connection_timeout=`, ...) is the
client's, aiormq's or aio-pika's, as before.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from dedupe.errors import ConfigurationError
from dedupe.plugins import UrlOption

QUEUE_TYPES = ("classic", "quorum")

# RabbitMQ's own delivery limit on the quorum queues we declare. The broker counts every
# return of a message to its queue (a nack-requeue at shutdown, a channel or connection lost
# with the message unacked, `dlq list` reading a dead letter and putting it back), and past
# the limit dead-letters it without our headers, or drops it from a queue without a
# dead-letter exchange (<channel>.dlq). Our claims count *attempts* in PostgreSQL and
# dead-letter at the handler's `max_attempts` with the reason; the broker's limit is only a
# backstop against a message returned forever, so it is far above any sane `max_attempts`.
# It is set explicitly: RabbitMQ 4 gives quorum queues a default limit of 20, 3.x none; and
# never -1, which RabbitMQ 4 reads as "unlimited" but 3.x as "over the limit at the first
# return" (checked on 3.10: the message went to the dead-letter queue at its first requeue).
DELIVERY_LIMIT = 100_000

# What each URL option means (docs/configuration.md); a test fails when one has no line.
MEANING = {
    "queue_type": "`classic` or `quorum`: the type of the queues the worker declares for a "
    "channel (the work queue, its `.dlq` and its delay queues). Quorum queues are replicated "
    f"across a cluster and get `x-delivery-limit={DELIVERY_LIMIT}` (our `max_attempts` counts "
    "attempts; see docs/operations.md). An existing queue keeps its type: switching needs "
    "new, drained or deleted queues",
    "batches_in_flight": "batches of one channel processed at once before the next one waits "
    "to grow: while that many run, arriving deliveries gather into one batch until one of them "
    "ends, no more can come (the batch and the running ones hold the whole `prefetch`) or 5 ms "
    "pass (one claim statement for many deliveries under load, none of the wait for a lone "
    "message); at least 1",
}


@dataclass(frozen=True, kw_only=True)
class RabbitOptions:
    """What the transport reads from the URL's query besides the client's own options."""

    queue_type: str = "classic"
    batches_in_flight: int = 1  # see MEANING

    def __post_init__(self) -> None:
        if self.batches_in_flight < 1:
            raise ConfigurationError(
                f"RabbitMQ option batches_in_flight={self.batches_in_flight} must be at least 1"
            )
        if self.queue_type not in QUEUE_TYPES:
            close = difflib.get_close_matches(self.queue_type, QUEUE_TYPES, n=1)
            hint = f" — did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(
                f"RabbitMQ option queue_type={self.queue_type!r}{hint} (known: "
                f"{', '.join(QUEUE_TYPES)})"
            )

    @property
    def quorum(self) -> bool:
        return self.queue_type == "quorum"

    def arguments(self, *, dead_letters: bool) -> dict[str, Any]:
        """The queue arguments the type adds to a queue (with a dead-letter exchange or not).

        A quorum queue that dead-letters (a delay queue: its expired messages go back to the
        work queue; the work queue: to `.dlq`) does so at least once: RabbitMQ keeps the
        message until the target queue has confirmed it, which needs `x-overflow=reject-publish`
        (the queues have no length limit, so nothing is ever rejected for it). The default,
        at most once, drops a deferred message whose work queue has no leader as it expires.
        """
        if not self.quorum:
            return {}
        arguments: dict[str, Any] = {"x-queue-type": "quorum", "x-delivery-limit": DELIVERY_LIMIT}
        if dead_letters:
            arguments["x-dead-letter-strategy"] = "at-least-once"
            arguments["x-overflow"] = "reject-publish"
        return arguments


DEFAULT = RabbitOptions()
DEFAULT_QUEUE_TYPE = DEFAULT.queue_type
DEFAULT_BATCHES_IN_FLIGHT = DEFAULT.batches_in_flight


def _integer(values: dict[str, str], name: str, default: int) -> int:
    if name not in values:
        return default
    try:
        return int(values[name])
    except ValueError:
        raise ConfigurationError(
            f"RabbitMQ option {name}={values[name]!r} is not a whole number"
        ) from None


@dataclass(frozen=True)
class BrokerUrl:
    """An AMQP URL taken apart: one client URL per node, in order, and our options."""

    nodes: tuple[str, ...]
    options: RabbitOptions

    @classmethod
    def parse(cls, url: str) -> BrokerUrl:
        """`amqp[s]://[user[:pass]@]host[:port][,host[:port]...][/vhost][?query]`."""
        parts = urlsplit(url)
        if parts.scheme not in ("amqp", "amqps"):
            raise ConfigurationError(f"expected an amqp:// or amqps:// URL, got {url!r}")
        userinfo, at, hostlist = parts.netloc.rpartition("@")
        hosts = [host.strip() for host in hostlist.split(",")]
        if hostlist and any(not host for host in hosts):
            raise ConfigurationError(
                "an empty node in the RabbitMQ URL's host list (write "
                "amqp://user:pass@host1:5672,host2:5672/vhost)"
            )
        values: dict[str, str] = {}
        kept: list[tuple[str, str]] = []
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name in MEANING:
                values[name] = value
            else:
                kept.append((name, value))  # the client's own (heartbeat=, ...)
        options = RabbitOptions(
            queue_type=values.get("queue_type", DEFAULT_QUEUE_TYPE),
            batches_in_flight=_integer(values, "batches_in_flight", DEFAULT_BATCHES_IN_FLIGHT),
        )
        query = urlencode(kept)
        nodes = tuple(
            urlunsplit((parts.scheme, f"{userinfo}{at}{host}", parts.path, query, parts.fragment))
            for host in (hosts if hostlist else [""])
        )
        return cls(nodes=nodes, options=options)


def url_options() -> list[UrlOption]:
    """The URL's options with their defaults and meanings, for the configuration reference."""
    return [
        UrlOption(
            name="queue_type",
            type="str",
            default=DEFAULT.queue_type,
            run_default="the same",
            meaning=MEANING["queue_type"],
        ),
        UrlOption(
            name="batches_in_flight",
            type="int",
            default=str(DEFAULT.batches_in_flight),
            run_default="the same",
            meaning=MEANING["batches_in_flight"],
        ),
    ]


__all__ = ["DEFAULT", "DELIVERY_LIMIT", "MEANING", "BrokerUrl", "RabbitOptions", "url_options"]
