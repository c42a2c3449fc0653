"""Prometheus metrics of a worker or a receiver (prometheus-client, a core dependency).

Three sources, chosen to cost the hot path as little as possible:

- per message, an observer: outcome counters and latency histograms (a dict look-up and a
  lock-free-ish increment each);
- at scrape time, a collector that reads counters the pipeline keeps anyway (Stats) and the
  in-flight count: nothing per message;
- every `interval_s`, three indexed queries: the age of the oldest in-progress claim, how
  far clean-up lags behind the expiry times, and the outbox's unsent rows (the relay's lag).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dedupe.claims.store import ClaimStore
from dedupe.effects import outbox
from dedupe.errors import StoreError
from dedupe.message import Message
from dedupe.pipeline.observers import Observer, outcome_of
from dedupe.pipeline.processor import Processor
from dedupe.transport import Settlement

logger = logging.getLogger(__name__)

# Claims and handlers run in milliseconds; the tail reaches a lease (30 s by default).
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
OUTCOMES = ("completed", "duplicate", "conflict", "dead_lettered", "deferred", "requeued")
# What the HTTP idempotency middleware (dedupe.asgi) made of a request it covers.
HTTP_OUTCOMES = (
    "new",
    "replayed",
    "conflict",
    "in_flight",
    "released_on_error",
    "lease_lost",
    "not_stored",
    "refused",
    "unavailable",
    "unkeyed",
    "too_long",
)

OLDEST_IN_PROGRESS_SQL = """
SELECT coalesce(extract(epoch FROM now() - min(claimed_at)), 0)::float8 AS oldest_s,
       count(*) FILTER (WHERE lease_until < now()) AS stuck
  FROM dedupe_claims WHERE status = 'in_progress'
"""
CLEANUP_LAG_SQL = """
SELECT coalesce(extract(epoch FROM now() - min(expires_at)), 0)::float8
  FROM dedupe_claims WHERE expires_at < now()
"""


class Metrics(Observer):
    """The metrics of one process, on a registry of its own (several per test process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.messages = Counter(
            "dedupe_messages",
            "Messages settled, by handler and outcome (completed, duplicate, conflict, "
            "dead_lettered, deferred, requeued)",
            ["handler", "outcome"],
            registry=self.registry,
        )
        self.claim_seconds = Histogram(
            "dedupe_claim_seconds",
            "Time of one batched claim statement, by handler",
            ["handler"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.handler_seconds = Histogram(
            "dedupe_handler_seconds",
            "Time of one run of a handler (one attempt), by handler and result (ok, error)",
            ["handler", "result"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.oldest_in_progress = Gauge(
            "dedupe_oldest_in_progress_age_seconds",
            "Age of the oldest claim still in progress (0 when none)",
            registry=self.registry,
        )
        self.stuck = Gauge(
            "dedupe_stuck_claims",
            "Claims in progress whose lease has lapsed and that nobody has taken over yet",
            registry=self.registry,
        )
        self.cleanup_lag = Gauge(
            "dedupe_cleanup_lag_seconds",
            "How long the oldest expired claim has waited for clean-up (0 when none)",
            registry=self.registry,
        )
        self.outbox_unsent = Gauge(
            "dedupe_outbox_unsent",
            "Outbox rows committed by handlers (ctx.publish) and not relayed yet",
            registry=self.registry,
        )
        self.outbox_oldest_unsent = Gauge(
            "dedupe_outbox_oldest_unsent_seconds",
            "Age of the oldest outbox row not relayed yet: the relay's lag (0 when none)",
            registry=self.registry,
        )
        self.outbox_refused_unsent = Gauge(
            "dedupe_outbox_refused_unsent",
            "Outbox rows not relayed yet that the broker refused at least once (retried)",
            registry=self.registry,
        )
        self.outbox_cleanup_lag = Gauge(
            "dedupe_outbox_cleanup_lag_seconds",
            "How long the oldest sent outbox row past its retention has waited for clean-up "
            "(0 when none; growing: no clean-up runs, see `dedupe-worker gc`)",
            registry=self.registry,
        )
        self.last_check = Gauge(
            "dedupe_claims_checked_timestamp_seconds",
            "When the claims table was last looked at for the gauges above",
            registry=self.registry,
        )
        self.http_requests = Counter(
            "dedupe_http_requests",
            "Requests covered by the idempotency middleware, by route and outcome (new, "
            "replayed, conflict, in_flight, released_on_error, lease_lost, not_stored, refused, "
            "unavailable, unkeyed)",
            ["route", "outcome"],
            registry=self.registry,
        )
        self._children: dict[tuple[str, str], Any] = {}
        self._timers: dict[tuple[str, str], Any] = {}
        self._http: dict[tuple[str, str], Any] = {}

    # -- the observer ------------------------------------------------------------------

    def claimed(self, handler: str, seconds: float, count: int) -> None:
        child = self._timers.get(("claim", handler))
        if child is None:
            child = self._timers[("claim", handler)] = self.claim_seconds.labels(handler)
        child.observe(seconds)

    def ran(self, handler: str, seconds: float, *, ok: bool) -> None:
        result = "ok" if ok else "error"
        child = self._timers.get((handler, result))
        if child is None:
            child = self._timers[(handler, result)] = self.handler_seconds.labels(handler, result)
        child.observe(seconds)

    def concluded(
        self,
        handler: str,
        scope: str,
        key: str,
        message: Message,
        settlement: Settlement,
        started: float,
    ) -> None:
        outcome = outcome_of(settlement)
        child = self._children.get((handler, outcome))
        if child is None:
            child = self._children[(handler, outcome)] = self.messages.labels(handler, outcome)
        child.inc()

    def http_answered(self, route: str, outcome: str) -> None:
        """One request through dedupe.asgi.IdempotencyMiddleware (an HTTP_OUTCOMES word)."""
        child = self._http.get((route, outcome))
        if child is None:
            child = self._http[(route, outcome)] = self.http_requests.labels(route, outcome)
        child.inc()

    # -- the sources read at scrape time -------------------------------------------------

    def watch_processor(self, processor: Processor) -> None:
        """Export the processor's own counters and its in-flight count at every scrape."""
        self.registry.register(_ProcessorCollector(processor))
        for name in processor.app.handlers:
            for outcome in OUTCOMES:  # present from the start: rate() needs a first sample
                self.messages.labels(name, outcome)

    def watch_receiver(self, stats: Mapping[str, int]) -> None:
        """Export the webhook receiver's counters (accepted, replayed, conflicts ...)."""
        self.registry.register(_ReceiverCollector(stats))

    # -- the source read every interval --------------------------------------------------

    async def check_claims(self, store: ClaimStore) -> None:
        """Refresh the gauges that need the claims and outbox tables (three indexed queries)."""
        try:
            async with store.pool.acquire() as conn:
                row = await conn.fetchrow(OLDEST_IN_PROGRESS_SQL)
                lag = await conn.fetchval(CLEANUP_LAG_SQL)
                unsent = await outbox.backlog(conn)
        except Exception as exc:
            raise StoreError(f"metrics query failed: {exc}") from exc
        self.oldest_in_progress.set(row["oldest_s"])
        self.stuck.set(row["stuck"])
        self.cleanup_lag.set(lag)
        self.outbox_unsent.set(unsent["unsent"])
        self.outbox_oldest_unsent.set(unsent["oldest_unsent_s"])
        self.outbox_refused_unsent.set(unsent["refused"])
        self.outbox_cleanup_lag.set(unsent["cleanup_lag_s"])
        self.last_check.set_to_current_time()

    async def check_claims_every(self, store: ClaimStore, interval_s: float) -> None:
        """check_claims in a loop until cancelled; failures are logged, not raised."""
        while True:
            try:
                await self.check_claims(store)
            except StoreError as exc:
                logger.warning("%s", exc)
            await asyncio.sleep(interval_s)

    def serve(self, host: str, port: int) -> Served:
        """Serve /metrics on host:port (0: any free port) from a thread until stopped."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        logger.info("metrics on http://%s:%d/metrics", host, server.server_port)

        def stop() -> None:
            server.shutdown()
            server.server_close()
            if thread is not threading.current_thread():
                thread.join(timeout=5)

        return Served(port=int(server.server_port), stop=stop)


@dataclass(frozen=True, slots=True)
class Served:
    """A running metrics endpoint: its port and how to stop it."""

    port: int
    stop: Callable[[], None]


class _ProcessorCollector(Collector):
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    def collect(self) -> Iterator[Any]:
        stats = self.processor.stats
        counters = {
            "dedupe_retries": ("Attempts that failed and were retried", stats.retried),
            "dedupe_lease_takeovers": (
                "Keys claimed from a worker whose lease had lapsed",
                stats.taken_over,
            ),
            "dedupe_fenced_completions": (
                "Completions refused by the fencing token: a zombie's writes rolled back",
                stats.fenced,
            ),
            "dedupe_lease_lost": ("Runs that lost their claim to another worker", stats.lease_lost),
            "dedupe_cleanup_deleted_rows": (
                "Expired claims deleted by this process's clean-up",
                stats.gc_deleted,
            ),
            "dedupe_outbox_cleanup_deleted_rows": (
                "Sent outbox rows past their retention deleted by this process's clean-up",
                stats.outbox_gc_deleted,
            ),
            "dedupe_group_commits": (
                "COMMITs of group-commit lanes (group_commit=True handlers)",
                stats.groups_committed,
            ),
            "dedupe_group_commit_members": (
                "Runs completed by those COMMITs (divided by dedupe_group_commits: the group size)",
                stats.group_members_committed,
            ),
        }
        # The outbox relay's own counts (zero where the worker has no publisher).
        relay = getattr(self.processor, "relay", None)
        relayed = relay.stats if relay is not None else outbox.RelayStats()
        counters["dedupe_outbox_relayed"] = (
            "Outbox rows this worker relayed with the broker's confirm",
            relayed.sent,
        )
        counters["dedupe_outbox_refused"] = (
            "Outbox publishes the broker refused (each retried with backoff, never dropped)",
            relayed.refused,
        )
        counters["dedupe_one_transaction_runs"] = (
            "First deliveries claimed, run and completed in one transaction (one_transaction=True)",
            stats.one_transaction,
        )
        for name, (text, value) in counters.items():
            yield CounterMetricFamily(name, text, value=value)
        fallbacks = CounterMetricFamily(
            "dedupe_one_transaction_fallbacks",
            "Messages of one_transaction=True handlers that took the two-commit path, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(stats.one_transaction_fallbacks.items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
        dead = CounterMetricFamily(
            "dedupe_dead_letters", "Messages dead-lettered, by reason", labels=["reason"]
        )
        for reason, count in sorted(stats.dead_lettered.items()):
            dead.add_metric([reason], count)
        yield dead
        yield GaugeMetricFamily(
            "dedupe_in_flight",
            "Messages being claimed, run or settled",
            value=self.processor.in_flight,
        )


class _ReceiverCollector(Collector):
    def __init__(self, stats: Mapping[str, int]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "dedupe_webhook_requests",
            "Webhook requests by outcome (accepted, replayed, conflicts, in_flight, "
            "unauthenticated, broker_unavailable, broker_refused, store_unavailable)",
            labels=["outcome"],
        )
        for outcome, count in sorted(collections.Counter(self.stats).items()):
            family.add_metric([outcome], count)
        yield family


__all__ = ["HTTP_OUTCOMES", "LATENCY_BUCKETS_S", "Metrics"]
