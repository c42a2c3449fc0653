"""The claim protocol against a real PostgreSQL: one run per key, fencing, leases, attempts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context, Reject, Retry
from dedupe.claims.records import ClaimRequest, Fence, Reason
from dedupe.claims.store import ClaimStore, Cleaned
from dedupe.errors import ConfigurationError
from dedupe.operations.claims import ClaimAdmin
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action
from tests.conftest import eventually

CH = "work"


class Job(BaseModel):
    n: int


def job(key: str, n: int = 1, **kwargs: object) -> MemoryDelivery:
    return MemoryDelivery(make_message(CH, json.dumps({"n": n}), message_id=key, **kwargs))  # type: ignore[arg-type]


@pytest.fixture
async def effects(db: asyncpg.Connection) -> asyncpg.Connection:
    """A side-effect table without a unique constraint, so a double write would show."""
    await db.execute("CREATE TABLE effects (key text NOT NULL, n int NOT NULL, worker text)")
    return db


@pytest.fixture
async def second_store(db_url: str) -> AsyncIterator[ClaimStore]:
    """A store with another owner: a second worker on the same database."""
    async with ClaimStore.open(db_url, owner="worker-b", max_size=10) as other:
        yield other


def counting_app(calls: list[str], *, delay_s: float = 0.0, **options: object) -> App:
    app = App("t")

    @app.handler(CH, **options)  # type: ignore[arg-type]
    async def work(payload: Job, ctx: Context) -> dict[str, int]:
        calls.append(ctx.key)
        await asyncio.sleep(delay_s)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        return {"n": payload.n}

    return app


async def process(processor: Processor, *deliveries: MemoryDelivery) -> list[Action]:
    await processor.process(CH, list(deliveries))
    return [d.settlements[-1].action for d in deliveries]


async def test_concurrent_duplicates_run_the_handler_once(
    store: ClaimStore, second_store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Eight deliveries of one key at once, on two workers, give one run and one write."""
    calls: list[str] = []
    app = counting_app(calls, delay_s=0.3)
    async with Processor(app, store) as a, Processor(app, second_store) as b:
        deliveries = [job("k1") for _ in range(8)]
        await asyncio.gather(*(process(a if i % 2 else b, d) for i, d in enumerate(deliveries)))
        outcomes = [d.settlements[-1] for d in deliveries]
        assert calls == ["k1"]
        assert sum(o.action is Action.ACK and not o.duplicate for o in outcomes) == 1
        # The others were either told to come back later or recognised as duplicates.
        assert all(o.action in (Action.ACK, Action.DEFER) for o in outcomes)
        # Redelivering the deferred ones now finds the outcome: acknowledged, not run.
        deferred = sum(d.settlements[-1].action is Action.DEFER for d in deliveries)
        for _ in range(deferred):
            assert await process(a, job("k1")) == [Action.ACK]
    assert calls == ["k1"]
    assert await effects.fetchval("SELECT count(*) FROM effects") == 1


async def test_the_same_key_twice_in_one_batch_runs_once(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A batch holding a key twice claims it once; the second copy is a duplicate."""
    calls: list[str] = []
    async with Processor(counting_app(calls), store) as processor:
        first, second, other = job("k"), job("k"), job("other")
        assert await process(processor, first, second, other) == [Action.ACK] * 3
    assert sorted(calls) == ["k", "other"]
    assert second.settlements[-1].duplicate
    assert json.loads(second.settlements[-1].result or "null") == {"n": 1}


async def test_a_crash_after_the_claim_leads_to_exactly_one_completion_after_the_lease(
    store: ClaimStore, db: asyncpg.Connection, effects: asyncpg.Connection
) -> None:
    """A key claimed by a worker that died is deferred until its lease lapses, then taken over."""
    calls: list[str] = []
    app = counting_app(calls, lease_s=1.0)
    message = job("k").message
    # The dead worker's claim: made, never completed.
    [claim] = await store.claim_batch(
        [ClaimRequest("t.work", "k", message.payload_hash)], lease_s=1.0, retention_s=3600
    )
    assert claim.owned
    async with Processor(app, store) as processor:
        assert await process(processor, job("k")) == [Action.DEFER]
        await asyncio.sleep(1.1)
        assert await process(processor, job("k")) == [Action.ACK]
        assert await process(processor, job("k")) == [Action.ACK]
    assert calls == ["k"]
    row = await db.fetchrow("SELECT status, token, attempts FROM dedupe_claims")
    assert (row["status"], row["attempts"]) == ("completed", 2)
    assert row["token"] > (claim.token or 0)  # a new token for the take-over
    assert await effects.fetchval("SELECT count(*) FROM effects") == 1


async def test_a_zombie_cannot_complete_and_its_db_writes_roll_back(
    store: ClaimStore, second_store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A worker frozen past its lease is fenced: its completion fails and its writes vanish."""
    started, release = asyncio.Event(), asyncio.Event()
    app = App("t")

    @app.handler(CH, lease_s=1.0)
    async def work(payload: Job, ctx: Context) -> None:
        run = str(ctx.attempt)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2, $3)", ctx.key, payload.n, run)
        if ctx.attempt == 1:  # the zombie's run: frozen until we let it go
            started.set()
            await release.wait()

    # The zombie never heartbeats (as if SIGSTOPped); the healthy worker does.
    async with (
        Processor(app, store, heartbeat_s=3600) as zombie,
        Processor(app, second_store) as healthy,
    ):
        zombie_delivery = job("k")
        zombie_run = asyncio.create_task(process(zombie, zombie_delivery))
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.sleep(1.2)  # the lease lapses
        assert await process(healthy, job("k")) == [Action.ACK]  # take-over, attempt 2
        release.set()
        assert await zombie_run == [Action.DEFER]
        assert zombie_delivery.settlements[-1].detail == "lease lost"
        assert zombie.stats.lease_lost == 1
    rows = await effects.fetch("SELECT key, worker FROM effects")
    assert [tuple(r) for r in rows] == [("k", "2")]  # only the take-over's write survived


async def test_a_zombie_without_db_writes_is_fenced_at_its_batched_completion(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The batched completion (no ctx.db) is fenced too: the zombie's result never lands."""
    started, release = asyncio.Event(), asyncio.Event()
    app = App("t")

    @app.handler(CH, lease_s=1.0)
    async def work(payload: Job, ctx: Context) -> str:
        if ctx.key == "k" and ctx.attempt == 1:  # the zombie's run: frozen until let go
            started.set()
            await release.wait()
        return f"run {ctx.attempt}"

    async with (
        Processor(app, store, heartbeat_s=3600) as zombie,
        Processor(app, second_store) as healthy,
    ):
        zombie_delivery, others = job("k"), [job(f"o{i}") for i in range(5)]
        zombie_run = asyncio.create_task(process(zombie, zombie_delivery, *others))
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.sleep(1.2)  # the lease lapses
        assert await process(healthy, job("k")) == [Action.ACK]  # take-over, attempt 2
        # The batch's other messages were settled meanwhile: one stuck run holds up no other.
        assert all(d.settlements[-1].action is Action.ACK for d in others if d.settlements)
        assert all(d.settlements for d in others)
        release.set()
        # The zombie's completion was refused.
        assert await zombie_run == [Action.DEFER] + [Action.ACK] * 5
        assert zombie_delivery.settlements[-1].detail == "lease lost"
        assert (zombie.stats.fenced, zombie.stats.lease_lost, zombie.stats.completed) == (1, 1, 5)
    result = await db.fetchval("SELECT result FROM dedupe_claims WHERE key = 'k'")
    assert json.loads(result) == "run 2"


async def test_a_heartbeat_that_finds_the_token_changed_cancels_the_handler(
    store: ClaimStore, db: asyncpg.Connection, effects: asyncpg.Connection
) -> None:
    """When another worker owns the key now, the running handler is cancelled at once."""
    started, cancelled = asyncio.Event(), asyncio.Event()
    app = App("t")

    @app.handler(CH, lease_s=3.0)
    async def work(payload: Job, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with Processor(app, store, heartbeat_s=0.1) as processor:
        delivery = job("k")
        running = asyncio.create_task(process(processor, delivery))
        await asyncio.wait_for(started.wait(), 5)
        await db.execute("UPDATE dedupe_claims SET token = token + 1")  # someone took it over
        assert await asyncio.wait_for(running, 5) == [Action.DEFER]
    assert cancelled.is_set()
    assert await effects.fetchval("SELECT count(*) FROM effects") == 0


async def test_heartbeats_keep_a_long_run_from_being_taken_over(
    store: ClaimStore, second_store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A run longer than its lease keeps the key while it heartbeats."""
    calls: list[str] = []
    app = counting_app(calls, delay_s=2.0, lease_s=0.9)
    async with Processor(app, store) as a, Processor(app, second_store) as b:
        running = asyncio.create_task(process(a, job("k")))
        await asyncio.sleep(1.5)  # past the first lease
        assert await process(b, job("k")) == [Action.DEFER]
        assert await running == [Action.ACK]
    assert calls == ["k"]


async def test_a_failing_handler_is_retried_then_dead_lettered_after_max_attempts(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Transient errors are retried with backoff; the last one dead-letters; later copies ack."""
    calls: list[int] = []
    app = App("t")

    @app.handler(CH, max_attempts=3, backoff_s=0.01, max_backoff_s=0.05)
    async def work(payload: Job, ctx: Context) -> None:
        calls.append(ctx.attempt)
        raise ConnectionError("provider down")

    async with Processor(app, store) as processor:
        delivery = job("k")
        assert await process(processor, delivery) == [Action.DEAD_LETTER]
        outcome = delivery.settlements[-1]
        assert outcome.reason is Reason.MAX_ATTEMPTS
        assert "provider down" in (outcome.detail or "")
        assert (outcome.scope, outcome.key) == ("t.work", "k")
        assert processor.stats.retried == 2
        # The dead-lettered key is terminal: a redelivery is acknowledged without running.
        again = job("k")
        assert await process(processor, again) == [Action.ACK]
        assert again.settlements[-1].duplicate
    assert calls == [1, 2, 3]
    row = await db.fetchrow("SELECT status, attempts, reason, error FROM dedupe_claims")
    assert (row["status"], row["attempts"], row["reason"]) == ("failed", 3, "max_attempts_exceeded")
    assert row["error"] == "3 attempts, last: ConnectionError: provider down"


async def test_attempts_survive_crash_loops_and_stop_them(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A key whose runs killed max_attempts workers is dead-lettered, not run again."""
    calls: list[str] = []
    app = counting_app(calls, max_attempts=3, lease_s=0.2)
    request = ClaimRequest("t.work", "k", job("k").message.payload_hash)
    for n in range(3):  # three workers claimed it, started it and died
        [claim] = await store.claim_batch([request], lease_s=0.2, retention_s=3600)
        assert claim.owned and claim.taken_over == (n > 0)
        if claim.taken_over:
            fence = Fence(claim.scope, claim.key, claim.token or 0)
            assert (
                await store.record_attempt(fence, attempt=n + 1, error=None, lease_s=0.2) == n + 1
            )
        await asyncio.sleep(0.25)
    async with Processor(app, store) as processor:
        delivery = job("k")
        assert await process(processor, delivery) == [Action.DEAD_LETTER]
        assert delivery.settlements[-1].reason is Reason.MAX_ATTEMPTS
        assert "started 3 times without finishing" in (delivery.settlements[-1].detail or "")
    assert calls == []
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "failed"


async def test_a_claim_never_started_is_not_charged_for_its_workers_crash(
    store: ClaimStore, db: asyncpg.Connection, effects: asyncpg.Connection
) -> None:
    """Claims taken over without a start do not count: bystanders of a crash loop survive it."""
    calls: list[str] = []
    app = counting_app(calls, max_attempts=2, lease_s=0.2)
    request = ClaimRequest("t.work", "k", job("k").message.payload_hash)
    for _ in range(4):  # claimed beside a poison message four times, never started
        [claim] = await store.claim_batch([request], lease_s=0.2, retention_s=3600)
        assert claim.owned
        await asyncio.sleep(0.25)
    async with Processor(app, store) as processor:
        assert await process(processor, job("k")) == [Action.ACK]
    assert calls == ["k"]
    assert await db.fetchval("SELECT attempts FROM dedupe_claims") == 2


async def test_errors_outside_retry_on_dead_letter_at_once(store: ClaimStore) -> None:
    """Only retry_on exceptions are transient; others dead-letter with handler_error."""
    calls: list[int] = []
    app = App("t")

    @app.handler(CH, retry_on=(ConnectionError,))
    async def work(payload: Job) -> None:
        calls.append(payload.n)
        raise ValueError("bad amount")

    async with Processor(app, store) as processor:
        delivery = job("k")
        assert await process(processor, delivery) == [Action.DEAD_LETTER]
    assert delivery.settlements[-1].reason is Reason.HANDLER_ERROR
    assert "ValueError: bad amount" in (delivery.settlements[-1].detail or "")
    assert calls == [1]


async def test_reject_and_retry_are_honoured(store: ClaimStore) -> None:
    """Reject dead-letters with its reason; Retry(delay_s) runs again after that delay."""
    attempts: list[int] = []
    app = App("t")

    @app.handler(CH)
    async def work(payload: Job, ctx: Context) -> str:
        attempts.append(ctx.attempt)
        if payload.n == 0:
            raise Reject("amount must be positive")
        if ctx.attempt == 1:
            raise Retry("not yet", delay_s=0.2)
        return "done"

    async with Processor(app, store) as processor:
        rejected = job("r", n=0)
        assert await process(processor, rejected) == [Action.DEAD_LETTER]
        assert rejected.settlements[-1].reason is Reason.REJECTED
        assert rejected.settlements[-1].detail == "amount must be positive"
        loop = asyncio.get_running_loop()
        began = loop.time()
        retried = job("k", n=1)
        assert await process(processor, retried) == [Action.ACK]
        assert loop.time() - began >= 0.2
        assert retried.settlements[-1].result == '"done"'
    assert attempts == [1, 1, 2]


async def test_another_payload_under_a_used_key_is_a_conflict_and_never_runs(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Same key, other body: dead-lettered as key_conflict, even when the lease has lapsed."""
    calls: list[str] = []
    app = counting_app(calls, lease_s=0.2)
    [claim] = await store.claim_batch(
        [ClaimRequest("t.work", "stale", job("stale", n=1).message.payload_hash)],
        lease_s=0.2,
        retention_s=3600,
    )
    assert claim.owned
    await asyncio.sleep(0.25)
    async with Processor(app, store) as processor:
        assert await process(processor, job("done", n=1)) == [Action.ACK]
        for key in ("done", "stale"):
            conflict = job(key, n=2)
            assert await process(processor, conflict) == [Action.DEAD_LETTER]
            assert conflict.settlements[-1].reason is Reason.KEY_CONFLICT
        assert processor.stats.conflicts == 2
    assert calls == ["done"]


async def test_missing_keys_and_invalid_payloads_are_dead_lettered_with_reasons(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """No key: missing_key before any claim. Bad JSON or schema: invalid_payload, key failed."""
    calls: list[str] = []
    async with Processor(counting_app(calls), store) as processor:
        no_key = MemoryDelivery(make_message(CH, '{"n": 1}'))
        bad_json = MemoryDelivery(make_message(CH, "{nope", message_id="j"))
        bad_schema = MemoryDelivery(make_message(CH, '{"n": "x"}', message_id="s"))
        await processor.process(CH, [no_key, bad_json, bad_schema])
        reasons = [d.settlements[-1].reason for d in (no_key, bad_json, bad_schema)]
        assert reasons == [Reason.MISSING_KEY, Reason.INVALID_PAYLOAD, Reason.INVALID_PAYLOAD]
        assert "n" in (bad_schema.settlements[-1].detail or "")
    assert calls == []
    statuses = await db.fetch("SELECT key, status FROM dedupe_claims ORDER BY key")
    assert [tuple(r) for r in statuses] == [("j", "failed"), ("s", "failed")]


async def test_a_graceful_stop_gives_the_key_back_at_once(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Past the shutdown timeout a run is cancelled, requeued, and its lease released."""
    started = asyncio.Event()
    app = App("t")

    @app.handler(CH, lease_s=30.0)
    async def work(payload: Job) -> None:
        started.set()
        await asyncio.sleep(30)

    async with Processor(app, store) as processor:
        delivery = job("k")
        running = asyncio.create_task(process(processor, delivery))
        await asyncio.wait_for(started.wait(), 5)
        await processor.drain(timeout_s=0.1)
        assert await running == [Action.REQUEUE]
    row = await db.fetchrow(
        "SELECT attempts, lease_until <= now() AS free, token FROM dedupe_claims"
    )
    assert (row["attempts"], row["free"]) == (0, True)
    [claim] = await second_store.claim_batch(
        [ClaimRequest("t.work", "k", delivery.message.payload_hash)], lease_s=5, retention_s=3600
    )
    assert claim.owned and (claim.token or 0) > row["token"]


async def test_keys_handed_back_at_a_graceful_stop_run_side_by_side_on_the_next_worker(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Keys a stopping worker gave back are counted once more but not run one at a time as
    a dead worker's keys are (four 0.5 s runs take about 0.5 s, not 2 s); a dead worker's
    keys still are."""
    stop = asyncio.Event()
    running: list[int] = []
    peak = [0]
    app = App("t")

    @app.handler(CH, lease_s=30.0)
    async def work(payload: Job, ctx: Context) -> int:
        running.append(1)
        peak[0] = max(peak[0], len(running))
        try:
            if not stop.is_set():
                await asyncio.sleep(30)  # the first worker stops meanwhile
            await asyncio.sleep(0.5)
        finally:
            running.pop()
        return ctx.attempt

    deliveries = [job(f"k{i}") for i in range(4)]
    async with Processor(app, store) as first:
        task = asyncio.create_task(process(first, *deliveries))

        async def all_started() -> bool:
            return len(running) == 4

        await eventually(all_started)
        await first.drain(timeout_s=0.1)
        assert await task == [Action.REQUEUE] * 4
    stop.set()
    peak[0] = 0
    again = [job(f"k{i}") for i in range(4)]
    async with Processor(app, second_store) as second:
        assert await process(second, *again) == [Action.ACK] * 4
    assert peak[0] == 4
    assert [json.loads(d.settlements[-1].result or "0") for d in again] == [1] * 4
    rows = await db.fetch("SELECT attempts, status, error FROM dedupe_claims")
    assert {(r["attempts"], r["status"], r["error"]) for r in rows} == {(1, "completed", None)}
    # The history says what happened: no operator released anything.
    events = await db.fetch("SELECT DISTINCT event FROM dedupe_claim_events")
    assert {r["event"] for r in events} == {"handed_back", "attempt"}


async def test_a_graceful_stop_keeps_a_dead_workers_keys_take_overs_with_their_counts(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A dead worker's keys, taken over here and stopped gracefully before they finished, stay
    take-overs (their next run is still alone: the crash is in their history), and no attempt
    is taken back that was not counted (the key that waited to run alone never started)."""
    started = asyncio.Event()
    app = App("t")

    @app.handler(CH, lease_s=5.0)
    async def work(payload: Job) -> None:
        started.set()
        await asyncio.sleep(30)

    requests = [ClaimRequest("t.work", k, job(k).message.payload_hash) for k in ("k1", "k2")]
    await second_store.claim_batch(requests, lease_s=0.2, retention_s=3600)  # then it died
    await asyncio.sleep(0.3)
    async with Processor(app, store) as processor:
        task = asyncio.create_task(process(processor, job("k1"), job("k2")))
        await asyncio.wait_for(started.wait(), 5)  # one runs alone, the other waits its turn
        await processor.drain(timeout_s=0.1)
        assert await task == [Action.REQUEUE] * 2
    rows = await db.fetch("SELECT attempts, error FROM dedupe_claims ORDER BY key")
    # Given back (no heartbeat extends them), but not 'handed back': the crash stays.
    assert [(r["attempts"], r["error"]) for r in rows] == [(1, "handed back after a take-over")] * 2
    claims = await second_store.claim_batch(requests, lease_s=5, retention_s=3600)
    assert all(c.owned and c.taken_over and not c.handed_back for c in claims)


async def test_released_failed_keys_run_again(store: ClaimStore) -> None:
    """An operator release turns a failed key claimable; the next delivery runs it."""
    fail = [True]
    app = App("t")

    @app.handler(CH, max_attempts=1)
    async def work(payload: Job) -> str:
        if fail[0]:
            raise ConnectionError("down")
        return "ok"

    async with Processor(app, store) as processor:
        assert await process(processor, job("k")) == [Action.DEAD_LETTER]
        assert await store.release("t.work", "k") == "failed"
        fail[0] = False
        delivery = job("k")
        assert await process(processor, delivery) == [Action.ACK]
        assert delivery.settlements[-1].result == '"ok"'
        assert await store.release("t.work", "k") is None  # completed keys stay completed


async def test_clean_up_removes_only_expired_rows(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """gc deletes expired outcomes and abandoned claims, never live ones; one runner at a time."""
    await db.execute(
        """
        INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, lease_until, expires_at)
        SELECT 's', 'expired-' || i, '\\x00', 'completed', 'w', NULL, now() - interval '1 s'
          FROM generate_series(1, 25) i;
        INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, lease_until, expires_at)
        VALUES ('s', 'fresh', '\\x00', 'completed', 'w', NULL, now() + interval '1 day'),
               ('s', 'failed-old', '\\x00', 'failed', 'w', NULL, now() - interval '1 s'),
               ('s', 'running', '\\x00', 'in_progress', 'w', now() + interval '1 min',
                now() - interval '1 s'),
               ('s', 'abandoned', '\\x00', 'in_progress', 'w', now() - interval '1 min',
                now() - interval '1 s');
        """
    )
    async with store.pool.acquire() as lock_holder:
        await lock_holder.execute("SELECT pg_advisory_lock($1)", 0x6465_6475_7065)
        assert await store.gc(batch_size=10) is None  # someone else is cleaning up
        await lock_holder.execute("SELECT pg_advisory_unlock($1)", 0x6465_6475_7065)
    assert await store.gc(batch_size=10) == Cleaned(claims=27, outbox=0)
    left = await db.fetch("SELECT key FROM dedupe_claims ORDER BY key")
    assert [r["key"] for r in left] == ["fresh", "running"]


async def test_clean_up_and_purge_on_a_hash_partitioned_table_delete_only_their_rows(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The partitioning recipe of docs/operations.md: gc and purge delete the expired or old
    rows of every partition and never a live row that sits at the same place in another."""
    await db.execute(
        """
        ALTER TABLE dedupe_claims RENAME TO dedupe_claims_old;
        CREATE TABLE dedupe_claims (LIKE dedupe_claims_old INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
            PARTITION BY HASH (scope, key);
        CREATE TABLE dedupe_claims_p0 PARTITION OF dedupe_claims
            FOR VALUES WITH (MODULUS 2, REMAINDER 0);
        CREATE TABLE dedupe_claims_p1 PARTITION OF dedupe_claims
            FOR VALUES WITH (MODULUS 2, REMAINDER 1);
        ALTER TABLE dedupe_claims ADD PRIMARY KEY (scope, key);
        DROP TABLE dedupe_claims_old CASCADE;
        INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, expires_at, updated_at)
        SELECT 's', 'k' || i, '\\x00', 'completed', 'w',
               now() + CASE WHEN i % 2 = 0 THEN interval '-1 s' ELSE interval '1 day' END,
               now() - CASE WHEN i % 2 = 0 THEN interval '2 days' ELSE interval '0 s' END
          FROM generate_series(1, 40) i;
        """
    )
    # Both partitions hold expired and live rows, so their row positions (ctid) coincide.
    per_partition = await db.fetch(
        "SELECT tableoid::regclass::text AS part, count(*) FILTER (WHERE expires_at < now())"
        " AS expired, count(*) AS rows FROM dedupe_claims GROUP BY 1 ORDER BY 1"
    )
    assert len(per_partition) == 2
    assert all(0 < r["expired"] < r["rows"] for r in per_partition)
    assert await store.gc(batch_size=7) == Cleaned(claims=20, outbox=0)
    left = await db.fetch("SELECT key FROM dedupe_claims")
    assert sorted(int(r["key"][1:]) for r in left) == list(range(1, 41, 2))
    await db.execute(
        "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, expires_at,"
        " updated_at) SELECT 's', 'old' || i, '\\x00', 'failed', 'w', now() + interval '1 day',"
        " now() - interval '2 days' FROM generate_series(1, 20) i"
    )
    assert await ClaimAdmin(store).purge(older_than_s=86400, batch_size=7) == 20
    left = await db.fetch("SELECT key FROM dedupe_claims")
    assert sorted(int(r["key"][1:]) for r in left) == list(range(1, 41, 2))


async def test_hooks_see_each_stage_in_order(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """claimed -> handled -> completed, each with the scope and key; duplicates run none."""
    seen: list[tuple[str, str, str]] = []
    app = counting_app([])

    @app.hook("claimed", "handled", "completed")
    async def record(stage: str, message: object, scope: str, key: str) -> None:
        seen.append((stage, scope, key))

    async with Processor(app, store) as processor:
        assert await process(processor, job("k")) == [Action.ACK]
        assert await process(processor, job("k")) == [Action.ACK]
    assert seen == [(stage, "t.work", "k") for stage in ("claimed", "handled", "completed")]


def test_hooks_are_validated_at_registration() -> None:
    """Unknown stages and sync functions are refused."""
    app = App("t")
    with pytest.raises(ConfigurationError, match="stages"):
        app.hook("after_lunch")
    with pytest.raises(ConfigurationError, match="async def"):
        app.hook("claimed")(lambda *args: None)  # type: ignore[arg-type,return-value]


async def test_a_failure_whose_dead_letter_never_went_out_is_dead_lettered_again(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A worker died between failing a key and its dead letter: the next copy is dead-lettered
    (not acked as a duplicate); once a dead letter is confirmed, later copies are acked."""
    app = counting_app([])
    request = ClaimRequest("t.work", "k", job("k").message.payload_hash)
    [claim] = await store.claim_batch([request], lease_s=5, retention_s=3600)
    fence = Fence(claim.scope, claim.key, claim.token or 0)
    # A detail with ': ' in it comes back whole, under its reason.
    detail = "5 attempts, last: ValueError: no: really"
    assert await store.fail(fence, reason=Reason.MAX_ATTEMPTS, detail=detail, retention_s=3600)
    async with Processor(app, store) as processor:
        again = job("k")
        assert await process(processor, again) == [Action.DEAD_LETTER]
        outcome = again.settlements[-1]
        assert (outcome.reason, outcome.detail) == (Reason.MAX_ATTEMPTS, detail)
        assert await db.fetchval("SELECT dead_lettered_at IS NOT NULL FROM dedupe_claims")
        later = job("k")
        assert await process(processor, later) == [Action.ACK]
        assert later.settlements[-1].duplicate


async def test_warm_up_opens_connections_with_the_claim_statements_planned_and_claims_nothing(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A started worker's first messages do not wait for connects and planning: warm_up opens
    the connections and runs each hot statement once with no rows, which changes nothing."""
    assert store.pool.get_size() == 1
    await store.warm_up(6)
    assert store.pool.get_size() == 6
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 0
    async with store.pool.acquire() as conn:
        cached = {s.query for s in conn._stmt_cache.iter_statements()}  # asyncpg's cache
    assert {store._q["claim_batch"], store._q["complete"], store._q["heartbeat"]} <= cached
    # A claim after it works as ever.
    (claim,) = await store.claim_batch([ClaimRequest("s", "k", b"h")], lease_s=30, retention_s=60)
    assert claim.owned


async def test_warm_up_never_waits_for_more_connections_than_the_pool_holds(db_url: str) -> None:
    """A worker with --concurrency 1 has a pool of 5: warming 8 takes the 5 and goes on (it
    waited forever for the other 3 before), and every connection is back in the pool."""
    async with ClaimStore.open(db_url, owner="w", max_size=5) as small:
        async with asyncio.timeout(10):
            await small.warm_up(8)
        assert small.pool.get_size() == 5
        assert small.pool.get_idle_size() == 5


async def test_warm_up_cut_off_by_its_timeout_gives_every_connection_back(
    db_url: str, db: asyncpg.Connection
) -> None:
    """A warm-up slower than its bound is abandoned with a warning, never an error, and leaves
    nothing held: the pool still closes at once."""
    async with db.transaction():
        await db.execute("LOCK TABLE dedupe_claims IN ACCESS EXCLUSIVE MODE")
        async with ClaimStore.open(db_url, owner="w", max_size=4) as store:
            async with asyncio.timeout(10):
                await store.warm_up(4, timeout_s=0.5)  # the claim statements wait on the lock
            assert store.pool.get_idle_size() == store.pool.get_size()
