"""Prometheus metrics fed by the pipeline, the claims table and the receiver."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import asyncpg
import httpx
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.records import ClaimRequest
from dedupe.claims.store import ClaimStore
from dedupe.observability.metrics import Metrics
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from tests.conftest import eventually

CH = "work"


class Job(BaseModel):
    n: int


def job(key: str, n: int = 1) -> MemoryDelivery:
    return MemoryDelivery(make_message(CH, json.dumps({"n": n}), message_id=key))


def value(metrics: Metrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def shop(calls: list[str], **options: object) -> App:
    app = App("m")

    @app.handler(CH, max_attempts=2, backoff_s=0.01, **options)  # type: ignore[arg-type]
    async def work(payload: Job, ctx: Context) -> None:
        calls.append(ctx.key)
        if payload.n < 0:
            raise RuntimeError("negative")

    return app


async def test_messages_are_counted_by_handler_and_outcome(store: ClaimStore) -> None:
    """Completed, duplicate, conflict and dead-lettered messages each have their counter."""
    metrics = Metrics()
    async with Processor(shop([]), store, observers=[metrics]) as processor:
        metrics.watch_processor(processor)
        await processor.process(CH, [job("a"), job("b")])
        await processor.process(CH, [job("a")])  # duplicate
        await processor.process(CH, [job("a", n=2)])  # same key, other payload
        await processor.process(CH, [job("c", n=-1)])  # fails twice, dead-lettered
    assert value(metrics, "dedupe_messages_total", handler="work", outcome="completed") == 2
    assert value(metrics, "dedupe_messages_total", handler="work", outcome="duplicate") == 1
    assert value(metrics, "dedupe_messages_total", handler="work", outcome="conflict") == 1
    assert value(metrics, "dedupe_messages_total", handler="work", outcome="dead_lettered") == 1
    assert value(metrics, "dedupe_retries_total") == 1
    assert value(metrics, "dedupe_dead_letters_total", reason="max_attempts_exceeded") == 1
    assert value(metrics, "dedupe_dead_letters_total", reason="key_conflict") == 1
    assert value(metrics, "dedupe_in_flight") == 0
    # one claim statement per batch, and one handler run per attempt
    assert value(metrics, "dedupe_claim_seconds_count", handler="work") == 4
    assert value(metrics, "dedupe_handler_seconds_count", handler="work", result="ok") == 2
    assert value(metrics, "dedupe_handler_seconds_count", handler="work", result="error") == 2
    assert value(metrics, "dedupe_claim_seconds_bucket", handler="work", le="0.001") <= 4


async def test_in_flight_counts_the_messages_of_running_batches(store: ClaimStore) -> None:
    """The in-flight gauge counts messages (not the tasks that run them) until settled."""
    metrics = Metrics()
    started, release = asyncio.Event(), asyncio.Event()
    app = App("m")

    @app.handler(CH)
    async def work(payload: Job) -> None:
        started.set()
        await release.wait()

    async with Processor(app, store, observers=[metrics]) as processor:
        metrics.watch_processor(processor)
        running = asyncio.create_task(processor.process(CH, [job(f"k{i}") for i in range(5)]))
        await asyncio.wait_for(started.wait(), 5)
        assert value(metrics, "dedupe_in_flight") == 5
        release.set()
        await running
        assert value(metrics, "dedupe_in_flight") == 0


async def test_take_overs_and_fenced_completions_are_counted(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A key claimed from a dead worker is a take-over; a completion after losing it is fenced."""
    metrics = Metrics()
    message = job("dead").message
    await store.claim_batch(
        [ClaimRequest("m.work", "dead", message.payload_hash)], lease_s=0.1, retention_s=3600
    )
    await asyncio.sleep(0.2)
    app = App("m")
    started, go_on = asyncio.Event(), asyncio.Event()

    @app.handler(CH, lease_s=30)
    async def work(payload: Job, ctx: Context) -> None:
        if ctx.key == "zombie":
            started.set()
            await go_on.wait()

    async with Processor(app, store, observers=[metrics], heartbeat_s=3600) as processor:
        metrics.watch_processor(processor)
        await processor.process(CH, [job("dead")])
        running = asyncio.create_task(processor.process(CH, [job("zombie")]))
        await asyncio.wait_for(started.wait(), 5)
        # another worker takes the key over meanwhile: the token moves on
        await db.execute("UPDATE dedupe_claims SET token = token + 1 WHERE key = 'zombie'")
        go_on.set()
        await running
    assert value(metrics, "dedupe_lease_takeovers_total") == 1
    assert value(metrics, "dedupe_fenced_completions_total") == 1


async def test_the_claims_table_gauges_show_stuck_work_and_clean_up_lag(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The oldest in-progress claim's age, lapsed leases and clean-up lag come from the table."""
    metrics = Metrics()
    await metrics.check_claims(store)
    assert value(metrics, "dedupe_oldest_in_progress_age_seconds") == 0
    assert value(metrics, "dedupe_cleanup_lag_seconds") == 0
    await db.execute(
        """INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, lease_until,
                                      claimed_at, expires_at)
           VALUES ('m.work', 'stuck', '\\x00', 'in_progress', 'w', now() - interval '1 minute',
                   now() - interval '10 minutes', now() + interval '1 day'),
                  ('m.work', 'old', '\\x00', 'completed', 'w', NULL,
                   now() - interval '2 days', now() - interval '1 hour')"""
    )
    await metrics.check_claims(store)
    assert 599 < value(metrics, "dedupe_oldest_in_progress_age_seconds") < 700
    assert value(metrics, "dedupe_stuck_claims") == 1
    assert 3599 < value(metrics, "dedupe_cleanup_lag_seconds") < 3700
    await store.gc()
    await metrics.check_claims(store)
    assert value(metrics, "dedupe_cleanup_lag_seconds") == 0


async def test_a_key_claimed_again_days_after_its_first_claim_is_not_old_work(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Stuck-work ages count from the current run's claim: a failed key released and claimed
    again today is seconds old, though the key was first claimed two days ago."""
    await db.execute(
        """INSERT INTO dedupe_claims (scope, key, payload_hash, status, retryable, owner,
                                      created_at, claimed_at, expires_at)
           VALUES ('m.work', 'k', '\\x00', 'failed', true, 'w', now() - interval '2 days',
                   now() - interval '2 days', now() + interval '1 day')"""
    )
    [claim] = await store.claim_batch(
        [ClaimRequest("m.work", "k", b"\x00")], lease_s=30, retention_s=3600
    )
    assert claim.owned
    metrics = Metrics()
    await metrics.check_claims(store)
    assert value(metrics, "dedupe_oldest_in_progress_age_seconds") < 60
    row = await db.fetchrow(
        "SELECT now() - created_at > interval '1 day' AS old FROM dedupe_claims"
    )
    assert row["old"]  # the key's own age is kept


async def test_the_metrics_endpoint_serves_the_prometheus_text_format(store: ClaimStore) -> None:
    """Metrics.serve answers /metrics over HTTP with the counters in Prometheus text."""
    metrics = Metrics()
    async with Processor(shop([]), store, observers=[metrics]) as processor:
        metrics.watch_processor(processor)
        await processor.process(CH, [job("a")])
        served = metrics.serve("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://127.0.0.1:{served.port}/metrics")
        finally:
            served.stop()
    assert response.status_code == 200
    assert 'dedupe_messages_total{handler="work",outcome="completed"} 1.0' in response.text
    assert "dedupe_in_flight 0.0" in response.text


OUTBOX_ROWS = """
INSERT INTO dedupe_outbox (producer, channel, message_id, body, created_at, attempts,
                           last_error, sent_at, expires_at)
VALUES ('m.work\x1fa', 'emails', 'e-1', 'x', now() - interval '10 minutes', 3,
        'ConnectionError: refused', NULL, now() + interval '1 day'),
       ('m.work\x1fb', 'emails', 'e-2', 'x', now(), 0, NULL, NULL, now() + interval '1 day'),
       ('m.work\x1fc', 'emails', 'e-3', 'x', now() - interval '2 days', 0, NULL,
        now() - interval '2 days', now() + interval '1 day')
"""


async def test_the_outbox_gauges_show_the_unsent_rows_and_the_relay_lag(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Rows committed and not yet relayed, the age of the oldest (the relay's lag) and those
    the broker refused at least once come from the outbox table; sent rows do not count."""
    metrics = Metrics()
    await metrics.check_claims(store)
    assert value(metrics, "dedupe_outbox_unsent") == 0
    assert value(metrics, "dedupe_outbox_oldest_unsent_seconds") == 0
    await db.execute(OUTBOX_ROWS)
    await metrics.check_claims(store)
    assert value(metrics, "dedupe_outbox_unsent") == 2
    assert 599 < value(metrics, "dedupe_outbox_oldest_unsent_seconds") < 700
    assert value(metrics, "dedupe_outbox_refused_unsent") == 1


class Refusing:
    """A publisher that refuses the first `fail` publishes, then takes every one."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.sent: list[str] = []

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("broker refused (simulated)")
        self.sent.append(message_id)

    async def close(self) -> None:
        pass


async def test_the_relays_sent_and_refused_publishes_are_counted(store: ClaimStore) -> None:
    """Every row relayed with the broker's confirm is counted, and so is every refusal."""
    metrics = Metrics()
    app = App("m")

    @app.handler(CH)
    async def work(payload: Job, ctx: Context) -> None:
        await ctx.publish("emails", {"n": payload.n})
        await ctx.publish("emails", {"n": payload.n + 1})

    publisher = Refusing(fail=2)
    async with Processor(app, store, observers=[metrics], publisher=publisher) as processor:
        metrics.watch_processor(processor)
        # present from the start: rate() needs a first sample
        assert metrics.registry.get_sample_value("dedupe_outbox_relayed_total") == 0
        assert processor.relay is not None
        processor.relay.interval_s = 0.05
        await processor.process(CH, [job("a")])

        async def relayed() -> bool:  # counted once the rows are marked sent
            return value(metrics, "dedupe_outbox_relayed_total") == 2

        await eventually(relayed, timeout_s=10)
        assert value(metrics, "dedupe_outbox_relayed_total") == 2
        assert value(metrics, "dedupe_outbox_refused_total") == 2
