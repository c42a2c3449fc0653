"""The Kafka transport's options, read from the broker URL (`kafka://host:9092?group_id=...`)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from dedupe.errors import ConfigurationError
from dedupe.plugins import UrlOption

# What each URL option means (docs/configuration.md); a test fails when a field has no line.
MEANING = {
    "group_id": "the consumer group; the workers of an app share it",
    "client_id": "the client's name in the broker's logs and metrics",
    "partitions": "partitions of the topics the worker creates (a channel, its `.dlq` and its "
    "`.retry.<bucket>` topics) when they do not exist",
    "replication_factor": "replicas of the topics it creates; 0 = min(3, brokers in the cluster)",
    "batch_max": "records per fetch, and per claim statement",
    "max_held": "messages held in memory per partition (deferrals under 5 s, requeues) before "
    "it stops fetching",
    "batches_in_flight": "fetched batches of one partition processed at once (their claims and "
    "completions overlap); at most max_held / batch_max, at least 1",
    "commit_interval_s": "period of the offset commits",
    "revoke_timeout_s": "on a rebalance, how long in-flight work of a revoked partition may "
    "finish; the rest goes to the next owner uncommitted",
    "session_timeout_ms": "the group drops a worker not heard from for this long "
    "(`session.timeout.ms`)",
    "heartbeat_interval_ms": "period of the heartbeats to the group (`heartbeat.interval.ms`)",
    "max_poll_interval_ms": "the group drops a worker that does not poll for this long "
    "(`max.poll.interval.ms`); the worker keeps polling while handlers run",
    "fetch_max_wait_ms": "how long the broker may hold a fetch to fill it "
    "(`fetch.max.wait.ms`): latency against batch size",
    "max_request_size": "the largest request the producer sends (`max.request.size`): caps "
    "dead letters and the receiver's messages (its body limit is fitted under it); raise it "
    "together with the topics' `max.message.bytes`",
}

# Defaults `run` gives the Kafka transport instead of KafkaOptions' own (KafkaTransport's
# constructor); a unit test checks each against the transport.
RUN_DEFAULT = {
    "group_id": "`dedupe-<app name>`",
    "client_id": "`DEDUPE_WORKER_NAME`",
    "batch_max": "`DEDUPE_PREFETCH` (8 x concurrency)",
    "revoke_timeout_s": "`DEDUPE_SHUTDOWN_TIMEOUT_S`, at most 10",
}


@dataclass(frozen=True, kw_only=True)
class KafkaOptions:
    """How the transport talks to Kafka; every field but the servers may be set in the URL
    (`kafka://host:9092,host2:9092?group_id=billing&partitions=8`)."""

    bootstrap_servers: str
    group_id: str = "dedupe-worker"
    client_id: str = "dedupe-worker"
    partitions: int = 4  # for topics this transport creates
    replication_factor: int = 0  # for topics it creates; 0 = min(3, brokers in the cluster)
    batch_max: int = 256  # messages per process() call (one claim statement)
    max_held: int = 1000  # deferred messages kept per partition before it stops fetching
    batches_in_flight: int = 4  # fetched batches of one partition at once (see `depth`)
    commit_interval_s: float = 0.2
    revoke_timeout_s: float = 10.0
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000
    fetch_max_wait_ms: int = 100
    # The largest request the producer sends (aiokafka's max_request_size): caps dead letters
    # and the receiver's messages. Raise it with the topic's max.message.bytes.
    max_request_size: int = 1_048_576

    @classmethod
    def from_url(cls, url: str, **defaults: Any) -> KafkaOptions:
        """Parse `kafka://servers?option=value`; URL options win over `defaults`."""
        parts = urlsplit(url)
        if parts.scheme != "kafka" or not parts.netloc:
            raise ConfigurationError(f"expected kafka://host:port[,host:port...], got {url!r}")
        types = {f.name: f.type for f in fields(cls) if f.name != "bootstrap_servers"}
        values: dict[str, Any] = dict(defaults)
        for name, raw in parse_qsl(parts.query, keep_blank_values=True):
            if name not in types:
                close = difflib.get_close_matches(name, list(types), n=1)
                hint = f" — did you mean {close[0]!r}?" if close else ""
                raise ConfigurationError(
                    f"unknown Kafka option {name!r} in the broker URL{hint} (known: "
                    f"{', '.join(types)})"
                )
            convert = {"int": int, "float": float}.get(str(types[name]), str)
            try:
                values[name] = convert(raw)
            except ValueError as exc:
                raise ConfigurationError(f"Kafka option {name}={raw!r}: {exc}") from exc
        options = cls(bootstrap_servers=parts.netloc, **values)
        options.check()
        return options

    def check(self) -> None:
        for name in (
            "partitions",
            "batch_max",
            "max_held",
            "batches_in_flight",
            "heartbeat_interval_ms",
            "max_request_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"Kafka option {name} must be at least 1")
        if self.commit_interval_s <= 0 or self.revoke_timeout_s < 0:
            raise ConfigurationError("commit_interval_s must be > 0 and revoke_timeout_s >= 0")
        if not self.group_id:
            raise ConfigurationError("Kafka option group_id must not be empty")

    @property
    def depth(self) -> int:
        """Fetched batches of one partition in flight at once: `batches_in_flight`, but no more
        records than `max_held` (what a partition may keep in memory) and at least one batch."""
        return max(1, min(self.batches_in_flight, self.max_held // self.batch_max))


def group_id_for(app_name: str) -> str:
    """The consumer group of an app's workers, unless the URL names one."""
    return f"dedupe-{app_name}"


def url_options() -> list[UrlOption]:
    """The URL's options with their defaults and meanings, for the configuration reference."""
    return [
        UrlOption(
            name=field.name,
            type=str(field.type),
            default=str(field.default),
            run_default=RUN_DEFAULT.get(field.name, "the same"),
            meaning=MEANING[field.name],
        )
        for field in fields(KafkaOptions)
        if field.name != "bootstrap_servers"
    ]


def with_options(url: str, **options: Any) -> str:
    """The URL with `?option=value` pairs added (e.g. a test's own group id)."""
    query = urlencode(options)
    return f"{url}{'&' if '?' in url else '?'}{query}" if query else url
