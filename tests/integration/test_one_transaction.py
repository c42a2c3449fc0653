"""One transaction where one is enough (`one_transaction=True`) against a real PostgreSQL (and
both brokers where they differ): a first delivery's claim, writes and completion commit once;
redeliveries, failures, steps, long runs and competing copies take the paths they must."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import aio_pika
import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context, Retry
from dedupe.claims.records import ClaimRequest, Fence, Reason
from dedupe.claims.store import ClaimStore
from dedupe.errors import ConfigurationError, InvalidOption
from dedupe.observability.metrics import Metrics
from dedupe.pipeline import one_transaction as onetx
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action
from tests.conftest import ADMIN_URL, AMQP_URL, eventually, running
from tests.integration.brokers import Broker

CH = "rows"


class Row(BaseModel):
    n: int


def deliveries(count: int, *, prefix: str = "k", redelivered: bool = False) -> list[MemoryDelivery]:
    return [
        MemoryDelivery(
            make_message(
                CH,
                json.dumps({"n": i}),
                message_id=f"{prefix}{i}",
                meta={"redelivered": redelivered},
            )
        )
        for i in range(count)
    ]


@pytest.fixture
async def effects(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE effects (key text PRIMARY KEY, n int NOT NULL)")
    return db


class Calls:
    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def __call__(self, key: str) -> int:
        self.count[key] = self.count.get(key, 0) + 1
        return self.count[key]


def writer(calls: Calls, *, channel: str = CH, lease_s: float = 30.0, **options: object) -> App:
    app = App("ot")

    @app.handler(
        channel,
        one_transaction=True,
        lease_s=lease_s,
        backoff_s=0.01,
        max_backoff_s=0.02,
        **options,  # type: ignore[arg-type]
    )
    async def write(payload: Row, ctx: Context) -> int:
        calls(ctx.key)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        return payload.n

    return app


# Commits of others in the test database that a window may catch (autovacuum, autoanalyze):
# less than half of the 20 that tell the two paths apart.
NOISE = 9


async def xact_commits(db_url: str) -> int:
    """The test database's committed transactions, read from another database (so that the
    reads do not count themselves)."""
    conn = await asyncpg.connect(ADMIN_URL)
    try:
        return int(
            await conn.fetchval(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = $1",
                db_url.rsplit("/", 1)[-1].split("?")[0],
            )
        )
    finally:
        await conn.close()


async def settled_count(db_url: str) -> int:
    """xact_commit once every backend has reported (the same count 1.1 s apart: an idle
    backend reports within a second, an exiting one as it exits)."""
    last = await xact_commits(db_url)
    for _ in range(10):
        await asyncio.sleep(1.1)
        now = await xact_commits(db_url)
        if now == last:
            return now
        last = now
    return last


async def commits(
    db_url: str, app: App, batches: list[list[MemoryDelivery]]
) -> tuple[int, Processor]:
    """The transactions the database committed for processing the batches (one process() call
    each, in turn): counted by PostgreSQL (pg_stat_database) on a pool of fixed size that is
    closed before the count is read (exiting backends report their counts), less the same
    pool opened and closed idle. Every release of a connection that served as ctx.db is one
    more (read-only) transaction: the pool's reset, the same on both paths."""

    async def measured(work: list[list[MemoryDelivery]]) -> tuple[int, Processor]:
        before = await settled_count(db_url)
        pool = ClaimStore.open(db_url, owner="test", min_size=8, max_size=8)
        async with pool as store, processor(app, store) as worker:
            for batch in work:
                await worker.process(CH, batch)
        return await settled_count(db_url) - before, worker

    idle, _ = await measured([])
    busy, worker = await measured(batches)
    return busy - idle, worker


def actions(items: Sequence[MemoryDelivery]) -> list[Action]:
    return [d.settlements[-1].action for d in items]


def processor(app: App, store: ClaimStore) -> Processor:
    # No clean-up and no heartbeat during the test: their statements would take xids too.
    return Processor(app, store, gc_interval_s=None, heartbeat_s=3600)


# -- the path ------------------------------------------------------------------------------


async def test_a_first_delivery_commits_once_with_its_claim_and_writes(
    db_url: str, effects: asyncpg.Connection
) -> None:
    """20 first deliveries, one per batch: 20 transactions (claim, write and completion in
    one each) and the 20 resets of their connections; the claim was made at the instant it
    was completed (now() is the transaction's start)."""
    calls = Calls()
    batch = deliveries(20)
    count, worker = await commits(db_url, writer(calls), [[d] for d in batch])
    assert actions(batch) == [Action.ACK] * 20
    # Exact but for other commits in the test database in either window (autovacuum's and
    # autoanalyze's count there too; a CI run once read 33): the two-commit path makes 60.
    assert abs(count - (20 + 20)) <= NOISE
    assert worker.stats.one_transaction == 20
    assert worker.stats.completed == 20
    assert not worker.stats.one_transaction_fallbacks
    same = await effects.fetchval(
        "SELECT count(*) FROM dedupe_claims c JOIN effects e ON e.key = c.key"
        " WHERE c.xmin = e.xmin AND c.claimed_at = c.updated_at"
        " AND c.status = 'completed' AND c.attempts = 1"
    )
    assert same == 20
    assert [d.settlements[-1].result for d in batch] == [str(i) for i in range(20)]


async def test_redeliveries_take_the_two_commit_path(
    db_url: str, effects: asyncpg.Connection
) -> None:
    """Redelivered messages, one per batch, are claimed in a statement of their own first:
    two commits each (and the reset of the ctx.db connection); none runs in one transaction.
    In one batch of 20, the claim statement is shared: 21 commits (and 20 resets)."""
    calls = Calls()
    batch = deliveries(20, redelivered=True)
    count, worker = await commits(db_url, writer(calls), [[d] for d in batch])
    assert actions(batch) == [Action.ACK] * 20
    assert count >= 20 + 20 + 20 - NOISE
    again = deliveries(20, prefix="b", redelivered=True)
    count, _ = await commits(db_url, writer(calls), [again])
    assert actions(again) == [Action.ACK] * 20
    assert 1 + 20 + 20 - NOISE <= count < 60
    assert not await effects.fetchval(
        "SELECT count(*) FROM dedupe_claims WHERE claimed_at = updated_at"
    )
    assert worker.stats.one_transaction == 0
    assert worker.stats.one_transaction_fallbacks == {onetx.REDELIVERY: 20}
    assert await effects.fetchval("SELECT count(*) FROM effects") == 40


async def test_a_key_with_a_row_leaves_the_path_and_is_a_duplicate(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    calls = Calls()
    tokens = "SELECT last_value FROM dedupe_claim_tokens"
    async with processor(writer(calls), store) as worker:
        await worker.process(CH, deliveries(3))
        drawn = await effects.fetchval(tokens)
        again = deliveries(3)  # a producer sent them twice: first deliveries again
        await worker.process(CH, again)
    assert [d.settlements[-1].duplicate for d in again] == [True] * 3
    assert await effects.fetchval(tokens) == drawn  # a duplicate draws no token
    assert worker.stats.one_transaction_fallbacks == {onetx.KEY_EXISTS: 3}
    assert calls.count == {"k0": 1, "k1": 1, "k2": 1}


async def test_a_key_twice_in_one_batch_runs_once(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    calls = Calls()
    batch = deliveries(2) + deliveries(1)
    async with processor(writer(calls), store) as worker:
        await worker.process(CH, batch)
    assert actions(batch) == [Action.ACK] * 3
    assert batch[2].settlements[-1].duplicate
    assert worker.stats.one_transaction == 2
    assert worker.stats.one_transaction_fallbacks == {onetx.REPEAT: 1}
    assert calls.count == {"k0": 1, "k1": 1}


async def test_a_handler_without_ctx_db_use_and_a_publish_commit_in_the_transaction(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    app = App("ot")

    @app.handler(CH, one_transaction=True)
    async def publish(payload: Row, ctx: Context) -> None:
        await ctx.publish("elsewhere", {"n": payload.n})

    batch = deliveries(2)
    async with processor(app, store) as worker:
        await worker.process(CH, batch)
    assert actions(batch) == [Action.ACK] * 2
    assert worker.stats.one_transaction == 2
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 2


async def test_the_transaction_is_bounded_and_the_lock_timeout_is_the_claims_alone(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """lock_timeout bounds the claim (a third of the lease, at most 2 s) and is lifted once the
    claim is in; the session is ended past the run's bound (the lease) plus 1 s, idle or not."""
    seen: dict[str, str] = {}
    app = App("ot")

    @app.handler(CH, one_transaction=True, lease_s=3.0)
    async def show(payload: Row, ctx: Context) -> None:
        for name in ("lock_timeout", "idle_in_transaction_session_timeout", "statement_timeout"):
            seen[name] = await ctx.db.fetchval(f"SHOW {name}")

    async with processor(app, store) as worker:
        await worker.process(CH, deliveries(1))
    assert worker.stats.one_transaction == 1
    assert seen == {
        "lock_timeout": "0",
        "idle_in_transaction_session_timeout": "4s",
        "statement_timeout": "4s",
    }
    assert onetx.begin_statement(app.handlers["show"]).startswith(
        "BEGIN; SET LOCAL lock_timeout = 1000;"
    )


# -- failures ------------------------------------------------------------------------------


async def test_a_failing_first_run_counts_its_attempt_and_retries_on_two_commits(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """The first run raises after its write: all of it rolls back, attempt 1 is committed on
    its own, the two-commit path runs attempt 2, which succeeds."""
    calls = Calls()
    app = App("ot")

    @app.handler(CH, one_transaction=True, backoff_s=0.01, max_backoff_s=0.02)
    async def flaky(payload: Row, ctx: Context) -> int:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        if calls(ctx.key) == 1:
            raise RuntimeError("the first run fails after its write")
        return ctx.attempt

    batch = deliveries(1)
    async with processor(app, store) as worker:
        await worker.process(CH, batch)
    assert actions(batch) == [Action.ACK]
    assert batch[0].settlements[-1].result == "2"  # ctx.attempt of the run that completed
    assert calls.count == {"k0": 2}
    assert await effects.fetchval("SELECT count(*) FROM effects") == 1
    row = await effects.fetchrow("SELECT status, attempts FROM dedupe_claims")
    assert (row["status"], row["attempts"]) == ("completed", 2)
    assert worker.stats.one_transaction_fallbacks == {onetx.FAILED: 1}
    assert worker.stats.taken_over == 0  # handed back, not a dead worker's key
    metrics = Metrics()
    metrics.watch_processor(worker)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
    }
    assert samples[("dedupe_one_transaction_runs_total", ())] == 0
    assert samples[("dedupe_one_transaction_fallbacks_total", (("reason", "failed"),))] == 1


async def test_a_first_run_that_asks_to_wait_is_parked_not_run_again_at_once(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Retry(delay_s=60) in the one transaction: attempt 1 is committed on its own and the
    message is deferred by 60 s through the broker, its key handed back. Before, the two-commit
    path ran attempt 2 at once, the asked-for wait ignored."""
    calls = Calls()
    app = App("ot")

    @app.handler(CH, one_transaction=True)
    async def later(payload: Row, ctx: Context) -> int:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        if calls(ctx.key) == 1:
            raise Retry("the provider says: in a minute", delay_s=60)
        return ctx.attempt

    batch = deliveries(1)
    async with processor(app, store) as worker:
        await worker.process(CH, batch)
    [outcome] = batch[0].settlements
    assert (outcome.action, outcome.delay_s) == (Action.DEFER, 60)
    assert calls.count == {"k0": 1}
    row = await effects.fetchrow(
        "SELECT status, attempts, error, lease_until <= now() AS free FROM dedupe_claims"
    )
    assert (row["status"], row["attempts"], row["error"], row["free"]) == (
        "in_progress",
        1,
        "handed back",
        True,
    )
    assert await effects.fetchval("SELECT count(*) FROM effects") == 0


async def test_a_poison_message_is_dead_lettered_after_max_attempts_runs_in_all(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    calls = Calls()
    app = App("ot")

    @app.handler(CH, one_transaction=True, max_attempts=3, backoff_s=0.01, max_backoff_s=0.02)
    async def poison(payload: Row, ctx: Context) -> None:
        calls(ctx.key)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        raise RuntimeError("always fails")

    batch = deliveries(1)
    async with processor(app, store) as worker:
        await worker.process(CH, batch)
    outcome = batch[0].settlements[-1]
    assert outcome.action is Action.DEAD_LETTER
    assert outcome.reason is Reason.MAX_ATTEMPTS
    assert calls.count == {"k0": 3}
    row = await effects.fetchrow("SELECT status, attempts FROM dedupe_claims")
    assert (row["status"], row["attempts"]) == ("failed", 3)
    assert await effects.fetchval("SELECT count(*) FROM effects") == 0


async def test_a_run_past_its_lease_is_rolled_back_and_runs_on_two_commits(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """Bound by the lease, not counted as a failure; timeout_s shorter than the lease is the
    bound and counts."""
    calls = Calls()
    app = App("ot")

    @app.handler(CH, one_transaction=True, lease_s=1.0)
    async def slow_once(payload: Row, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        if calls(ctx.key) == 1:
            await asyncio.sleep(1.5)

    @app.handler("timed", one_transaction=True, timeout_s=0.3, backoff_s=0.01)
    async def timed_once(payload: Row, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        if calls(ctx.key) == 1:
            await asyncio.sleep(1.0)

    slow = deliveries(1, prefix="slow")
    timed = [
        MemoryDelivery(
            make_message("timed", '{"n": 1}', message_id="t", meta={"redelivered": False})
        )
    ]
    async with processor(app, store) as worker:
        await worker.process(CH, slow)
        await worker.process("timed", timed)
    assert actions(slow) == actions(timed) == [Action.ACK]
    assert calls.count == {"slow0": 2, "t": 2}
    attempts = dict(await effects.fetch("SELECT key, attempts FROM dedupe_claims"))
    assert attempts == {"slow0": 1, "t": 2}
    assert worker.stats.one_transaction_fallbacks == {onetx.TOO_LONG: 1, onetx.FAILED: 1}
    assert await effects.fetchval("SELECT count(*) FROM effects") == 2


async def test_a_connection_lost_mid_transaction_commits_nothing_and_runs_again(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    calls = Calls()
    app = App("ot")

    @app.handler(CH, one_transaction=True)
    async def cut(payload: Row, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        if calls(ctx.key) == 1:
            await ctx.db.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    batch = deliveries(1)
    async with processor(app, store) as worker:
        await worker.process(CH, batch)
    assert actions(batch) == [Action.ACK]
    assert calls.count == {"k0": 2}
    row = await effects.fetchrow("SELECT status, attempts FROM dedupe_claims")
    assert (row["status"], row["attempts"]) == ("completed", 1)
    assert worker.stats.one_transaction_fallbacks == {onetx.STORE: 1}
    assert await effects.fetchval("SELECT count(*) FROM effects") == 1


async def test_ctx_step_sends_the_run_to_the_two_commit_path(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """ctx.step refuses to run in the one transaction (its record needs its own commit): the
    run rolls back before the step's function is called and runs again where steps work, even
    when the handler catches the error."""
    called: list[str] = []
    app = App("ot")

    @app.handler(CH, one_transaction=True)
    async def stepper(payload: Row, ctx: Context) -> object:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        try:
            return await ctx.step("charge", lambda: called.append(ctx.key) or "charged")
        except onetx.NeedsOwnCommits:
            return "swallowed"  # the run is rolled back all the same

    batch = deliveries(2)
    async with processor(app, store) as worker:
        await worker.process(CH, batch)
    assert actions(batch) == [Action.ACK] * 2
    assert [d.settlements[-1].result for d in batch] == ['"charged"'] * 2
    assert sorted(called) == ["k0", "k1"]
    assert worker.stats.one_transaction_fallbacks == {onetx.STEP: 2}
    assert worker.stats.one_transaction == 0
    row = await effects.fetchrow("SELECT max(attempts) AS a, count(*) AS n FROM dedupe_claims")
    assert (row["a"], row["n"]) == (1, 2)  # a step's fall-back is not a failed attempt
    assert await effects.fetchval("SELECT count(*) FROM effects") == 2


async def test_a_stop_gives_back_the_runs_that_wait_for_a_slot(
    store: ClaimStore, effects: asyncpg.Connection
) -> None:
    calls = Calls()
    app = App("ot")

    @app.handler(CH, one_transaction=True)
    async def slow(payload: Row, ctx: Context) -> None:
        calls(ctx.key)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        await asyncio.sleep(0.5)

    batch = deliveries(2)
    async with Processor(app, store, concurrency=1, gc_interval_s=None) as worker:
        running_batch = asyncio.create_task(worker.process(CH, batch))
        await asyncio.sleep(0.2)  # k0 runs, k1 waits for the one slot
        await worker.drain(timeout_s=5)
        await running_batch
    assert [d.settlements[-1].action for d in batch] == [Action.ACK, Action.REQUEUE]
    assert calls.count == {"k0": 1}
    assert worker.stats.one_transaction_fallbacks == {onetx.STOPPING: 1}


# -- competing copies ----------------------------------------------------------------------


def request(scope: str, key: str, body: bytes) -> ClaimRequest:
    import hashlib

    return ClaimRequest(scope, key, hashlib.sha256(body).digest())


async def test_a_competing_copy_waits_on_the_uncommitted_claim_then_is_a_duplicate(
    store: ClaimStore, db_url: str, effects: asyncpg.Connection
) -> None:
    """Another worker's one transaction holds the key (claimed, not committed, on a second
    connection): the redelivered copy's claim_batch (its NOT EXISTS read does not see the
    row, its upsert then waits on it) and a first delivery's claim (within lock_timeout)
    both wait; once the holder commits its completion, both are duplicates, never run."""
    calls = Calls()
    body = b'{"n": 1}'
    holder = await asyncpg.connect(db_url)
    try:
        app = writer(calls)
        scope = "ot.write"
        await holder.execute("BEGIN")
        token = await store.claim_in(
            holder, request(scope, "k", body), lease_s=30, retention_s=7 * 86400
        )
        assert token is not None
        copies = [
            MemoryDelivery(make_message(CH, body, message_id="k", meta={"redelivered": r}))
            for r in (True, False)
        ]
        async with processor(app, store) as worker:
            running_copies = [asyncio.create_task(worker.process(CH, [copy])) for copy in copies]
            await asyncio.sleep(1.0)
            assert not any(copy.settlements for copy in copies)  # both wait on the row lock
            waiting = await effects.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
            assert waiting == 2
            await store.complete([(Fence(scope, "k", token), "7", 86400.0)], conn=holder)
            await holder.execute("COMMIT")
            await asyncio.gather(*running_copies)
    finally:
        await holder.close()
    assert [c.settlements[-1].action for c in copies] == [Action.ACK, Action.ACK]
    assert [c.settlements[-1].duplicate for c in copies] == [True, True]
    assert [c.settlements[-1].result for c in copies] == ["7", "7"]
    assert calls.count == {}


async def test_a_claim_that_meets_lock_timeout_is_in_flight_elsewhere(
    store: ClaimStore, db_url: str, effects: asyncpg.Connection
) -> None:
    calls = Calls()
    body = b'{"n": 1}'
    holder = await asyncpg.connect(db_url)
    try:
        await holder.execute("BEGIN")
        await store.claim_in(holder, request("ot.write", "k", body), lease_s=30, retention_s=1e6)
        copy = MemoryDelivery(make_message(CH, body, message_id="k", meta={"redelivered": False}))
        async with processor(writer(calls, lease_s=1.5), store) as worker:  # lock_timeout 0.5 s
            await asyncio.wait_for(worker.process(CH, [copy]), timeout=5)
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()
    outcome = copy.settlements[-1]
    assert outcome.action is Action.DEFER
    assert outcome.detail == "key in progress elsewhere"
    assert worker.stats.one_transaction_fallbacks == {onetx.LOCK_TIMEOUT: 1}
    assert calls.count == {}


async def test_two_workers_racing_on_one_first_delivery_run_it_once(
    store: ClaimStore, db_url: str, effects: asyncpg.Connection
) -> None:
    calls = Calls()
    app = App("ot")

    @app.handler(CH, one_transaction=True)
    async def slow(payload: Row, ctx: Context) -> int:
        calls(ctx.key)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.key, payload.n)
        await asyncio.sleep(0.5)
        return payload.n

    async with ClaimStore.open(db_url, owner="other", max_size=5) as other:
        first, second = deliveries(1), deliveries(1)
        async with processor(app, store) as one, processor(app, other) as two:
            await asyncio.gather(one.process(CH, first), two.process(CH, second))
    outcomes = [first[0].settlements[-1], second[0].settlements[-1]]
    assert [o.action for o in outcomes] == [Action.ACK, Action.ACK]
    assert sorted(o.duplicate for o in outcomes) == [False, True]
    assert calls.count == {"k0": 1}
    assert one.stats.one_transaction + two.stats.one_transaction == 1


# -- registration --------------------------------------------------------------------------


def test_registration_refuses_what_one_transaction_cannot_hold() -> None:
    app = App("ot")
    with pytest.raises(ValueError, match="one_transaction"):

        @app.handler(CH, one_transaction=True)
        async def no_ctx(payload: Row) -> None: ...

    with pytest.raises(InvalidOption, match="one_transaction=True and group_commit=True"):

        @app.handler(CH, one_transaction=True, group_commit=True)
        async def both(payload: Row, ctx: Context) -> None: ...

    with pytest.raises(ConfigurationError, match="one_transaction must be True or False"):

        @app.handler(CH, one_transaction=1)  # type: ignore[arg-type]
        async def not_bool(payload: Row, ctx: Context) -> None: ...

    assert not app.handlers


# -- on the brokers ------------------------------------------------------------------------


async def test_first_deliveries_on_each_broker(
    broker: Broker, channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """RabbitMQ: every first delivery runs in one transaction. Kafka: the partition's first
    batch after its assignment takes the two-commit path (its last owner may have read it),
    the batches after it run in one transaction."""
    calls = Calls()
    app = App("ot")

    @app.handler(channel, key="body:k", one_transaction=True)
    async def write(payload: dict[str, object], ctx: Context) -> None:
        calls(ctx.key)
        await ctx.db.execute("INSERT INTO effects VALUES ($1, 0)", ctx.key)

    def messages(start: int, end: int) -> list[tuple[bytes, dict[str, str], str]]:
        return [(json.dumps({"k": f"m{i}"}).encode(), {}, f"m{i}") for i in range(start, end)]

    transport = broker.transport()
    await broker.publish(channel, messages(0, 10), partition=0)
    async with running(app, store, transport) as worker:
        await eventually(lambda: _count(effects, 10))
        await broker.publish(channel, messages(10, 20), partition=0)
        await eventually(lambda: _count(effects, 20))
        stats = worker.stats
    assert calls.count == {f"m{i}": 1 for i in range(20)}
    if broker.name == "rabbitmq":
        assert stats.one_transaction == 20
        assert not stats.one_transaction_fallbacks
    else:
        assert stats.one_transaction_fallbacks[onetx.REDELIVERY] >= 1
        assert stats.one_transaction >= 10  # the second publish came after the first batch
        assert stats.one_transaction + stats.one_transaction_fallbacks[onetx.REDELIVERY] == 20


async def _count(db: asyncpg.Connection, n: int) -> bool:
    return bool(await db.fetchval("SELECT count(*) FROM effects") >= n)


async def test_a_rabbitmq_redelivery_takes_the_two_commit_path(
    channel: str, store: ClaimStore, effects: asyncpg.Connection
) -> None:
    """A message the broker delivers again (rejected with requeue by a consumer before us)
    carries redelivered = True: claimed first, then run."""
    import dedupe_rabbitmq as rabbitmq

    calls = Calls()
    app = writer(calls, channel=channel)
    # Declare the queue as the worker does, publish, take the message once and give it back.
    async with running(app, store, rabbitmq.RabbitMQTransport(AMQP_URL)):
        pass
    await rabbitmq.publish(AMQP_URL, channel, [(b'{"n": 5}', {}, "once")])
    connection = await aio_pika.connect(AMQP_URL)
    try:
        ch = await connection.channel()
        queue = await ch.get_queue(channel, ensure=False)
        incoming = await eventually(lambda: queue.get(fail=False), timeout_s=10)
        await incoming.reject(requeue=True)
    finally:
        await connection.close()
    async with running(app, store, rabbitmq.RabbitMQTransport(AMQP_URL)) as worker:
        await eventually(lambda: _count(effects, 1))
        stats = worker.stats
    assert stats.one_transaction == 0
    assert stats.one_transaction_fallbacks == {onetx.REDELIVERY: 1}
    assert calls.count == {"once": 1}
