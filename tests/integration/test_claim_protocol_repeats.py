"""The claim protocol's last holes, against a real PostgreSQL: tokens are never issued twice,
claims waiting for a runner keep their lease and are handed back at a stop, statements sent
again after a lost reply count nothing twice, and a failed COMMIT is the store's failure."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.leases import Lease, Leases
from dedupe.claims.records import ClaimRequest, Fence, Reason
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action
from tests.conftest import eventually

CH = "work"


class Job(BaseModel):
    n: int


def job(key: str, n: int = 1) -> MemoryDelivery:
    return MemoryDelivery(make_message(CH, json.dumps({"n": n}), message_id=key))


def request(key: str) -> ClaimRequest:
    return ClaimRequest("t.work", key, job(key).message.payload_hash)


@pytest.fixture
async def second_store(db_url: str) -> AsyncIterator[ClaimStore]:
    async with ClaimStore.open(db_url, owner="worker-b", max_size=10) as other:
        yield other


# -- tokens ----------------------------------------------------------------------------------


async def test_a_key_deleted_and_claimed_again_never_gets_a_token_a_zombie_holds(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A zombie holds the first claim of a key; the row is deleted (clean-up, purge) and the
    key claimed again: the new token is another, so the zombie's completion is fenced off."""
    [zombie] = await store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    await db.execute("DELETE FROM dedupe_claims")  # `claims purge`, or clean-up after expiry
    [fresh] = await second_store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    assert zombie.owned and fresh.owned and fresh.token != zombie.token
    late = await store.complete([(Fence("t.work", "k", zombie.token or 0), "{}", 3600.0)])
    assert late == set()
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "in_progress"


async def test_a_dead_letter_is_recorded_against_the_failure_it_reports(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """mark_dead_lettered is fenced by token: the late confirm of an older failure's dead letter
    does not mark a newer failure of the key (claimed again after a release) as sent."""
    [first] = await store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    old = Fence("t.work", "k", first.token or 0)
    assert await store.fail(old, reason=Reason.HANDLER_ERROR, detail="x", retention_s=3600)
    await store.release("t.work", "k")
    [second] = await store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    new = Fence("t.work", "k", second.token or 0)
    assert await store.fail(new, reason=Reason.HANDLER_ERROR, detail="y", retention_s=3600)
    await store.mark_dead_lettered([old])
    assert await db.fetchval("SELECT dead_lettered_at FROM dedupe_claims") is None
    await store.mark_dead_lettered([new])
    assert await db.fetchval("SELECT dead_lettered_at IS NOT NULL FROM dedupe_claims")


# -- claims waiting for a runner -------------------------------------------------------------


def slow_app(
    calls: list[str], *, delay_s: float, lease_s: float, started: asyncio.Event | None = None
) -> App:
    app = App("t")

    @app.handler(CH, lease_s=lease_s)
    async def work(payload: Job, ctx: Context) -> None:
        calls.append(ctx.key)
        if started is not None:
            started.set()
        await asyncio.sleep(delay_s)

    return app


async def test_claims_queued_behind_long_handlers_keep_their_lease(
    store: ClaimStore, second_store: ClaimStore
) -> None:
    """With one runner, a batch's third claim waits two handler runs, longer than its lease:
    the heartbeat keeps it ours, so another worker cannot take it over and run it twice."""
    calls: list[str] = []
    app = slow_app(calls, delay_s=0.8, lease_s=0.6)
    async with Processor(app, store, concurrency=1, heartbeat_s=0.15) as processor:
        batch = [job("a"), job("b"), job("c")]
        running = asyncio.create_task(processor.process(CH, batch))
        await asyncio.sleep(1.2)  # "c" has waited twice its lease by now
        [other] = await second_store.claim_batch([request("c")], lease_s=5, retention_s=3600)
        assert not other.owned and other.status == "in_progress" and other.lease_live
        await running
    assert calls == ["a", "b", "c"]
    assert [d.settlements[-1].action for d in batch] == [Action.ACK] * 3


async def test_a_stop_hands_back_queued_claims_at_once_and_is_bounded_by_its_timeout(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """drain() gives back the claims no handler runs yet at once (requeued, free for another
    worker, uncounted), and the run under way when the timeout strikes: the stop takes about
    the timeout, not the queued handlers' time."""
    calls: list[str] = []
    started = asyncio.Event()
    app = slow_app(calls, delay_s=30, lease_s=30, started=started)
    async with Processor(app, store, concurrency=1) as processor:
        batch = [job("a"), job("b"), job("c"), job("d")]
        running = asyncio.create_task(processor.process(CH, batch))
        await asyncio.wait_for(started.wait(), 5)
        began = time.monotonic()
        draining = asyncio.create_task(processor.drain(timeout_s=1.0))

        async def settled() -> bool:
            return all(d.settlements for d in batch[1:])

        # The queued ones are settled before the run under way is stopped, and free for
        # another worker.
        await eventually(settled, timeout_s=0.9)
        assert not draining.done()
        claims = await second_store.claim_batch(
            [request("b"), request("c"), request("d")], lease_s=30, retention_s=3600
        )
        assert all(c.owned for c in claims)
        assert [d.settlements[-1].action for d in batch[1:]] == [Action.REQUEUE] * 3
        await draining
        await running
        assert time.monotonic() - began < 3.0
    assert calls == ["a"]
    assert batch[0].settlements[-1].action is Action.REQUEUE
    attempts = dict(await db.fetch("SELECT key, attempts FROM dedupe_claims WHERE key = 'a'"))
    assert attempts == {"a": 0}  # the interrupted run was taken back


async def _withdrawn_once_the_first_runs(
    processor: Processor, batch: list[MemoryDelivery], started: asyncio.Event
) -> None:
    """Process the batch on one slot; once the first handler runs (1 s), the transport takes
    every delivery back: the batch ends with that run, well before a second one could."""
    running = asyncio.create_task(processor.process(CH, batch))
    await asyncio.wait_for(started.wait(), 5)
    began = time.monotonic()
    for delivery in batch:
        delivery.withdrawn = True
    await asyncio.wait_for(running, 5)
    assert time.monotonic() - began < 1.9


async def test_withdrawn_deliveries_are_given_back_not_run_and_the_run_under_way_finishes(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A transport that takes its deliveries back (a revoked Kafka partition) mid-batch: the
    run under way finishes, the claims no handler runs yet are given back (requeued, free for
    another worker, their attempt taken back), not run: the batch takes one handler's time,
    not four."""
    calls: list[str] = []
    started = asyncio.Event()
    app = slow_app(calls, delay_s=1.0, lease_s=30, started=started)
    async with Processor(app, store, concurrency=1) as processor:
        batch = [job("a"), job("b"), job("c"), job("d")]
        await _withdrawn_once_the_first_runs(processor, batch, started)
    assert calls == ["a"]
    assert batch[0].settlements[-1].action is Action.ACK
    assert [d.settlements[-1].action for d in batch[1:]] == [Action.REQUEUE] * 3
    assert processor.stats.requeued == 3 and processor.stats.completed == 1
    rows = await db.fetch(
        "SELECT key, attempts, lease_until <= now() AS free, error FROM dedupe_claims"
        " WHERE key <> 'a' ORDER BY key"
    )
    assert [tuple(r) for r in rows] == [(k, 0, True, "handed back") for k in "bcd"]
    claims = await second_store.claim_batch(
        [request("b"), request("c"), request("d")], lease_s=30, retention_s=3600
    )
    assert all(c.owned and c.handed_back for c in claims)


async def test_withdrawn_first_deliveries_of_a_one_transaction_handler_claim_nothing(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """one_transaction=True: a first delivery withdrawn while it waits for a slot is requeued
    without a claim (nothing to give back), rather than fall back to the two-commit path."""
    calls: list[str] = []
    started = asyncio.Event()
    app = App("t")

    @app.handler(CH, lease_s=30, one_transaction=True)
    async def work(payload: Job, ctx: Context) -> None:
        calls.append(ctx.key)
        started.set()
        await asyncio.sleep(1.0)

    def first(key: str) -> MemoryDelivery:
        message = make_message(
            CH, json.dumps({"n": 1}), message_id=key, meta={"redelivered": False}
        )
        return MemoryDelivery(message)

    async with Processor(app, store, concurrency=1) as processor:
        batch = [first("a"), first("b"), first("c")]
        await _withdrawn_once_the_first_runs(processor, batch, started)
    assert calls == ["a"]
    assert batch[0].settlements[-1].action is Action.ACK
    assert [d.settlements[-1].action for d in batch[1:]] == [Action.REQUEUE] * 2
    assert await db.fetch("SELECT key FROM dedupe_claims WHERE key <> 'a'") == []
    assert processor.stats.one_transaction == 1
    assert not processor.stats.one_transaction_fallbacks


# -- statements sent again after a lost reply -------------------------------------------------


async def test_a_claim_statement_sent_again_finds_its_own_claims(store: ClaimStore) -> None:
    """The same claim statement (same request id) sent twice, as after a reply lost on a broken
    connection: the second answer is the first's claims, not someone else's live leases."""
    sent = 0
    original = store._fetch

    async def twice(name: str, *args: object, conn: object = None) -> list[asyncpg.Record]:
        nonlocal sent
        if name == "claim_batch" and sent == 0:
            sent += 1
            await original(name, *args)  # committed; its reply is "lost"
        return await original(name, *args, conn=conn)

    store._fetch = twice  # type: ignore[method-assign]
    claims = await store.claim_batch([request("a"), request("b")], lease_s=30, retention_s=3600)
    assert sent == 1
    assert all(c.owned and not c.taken_over for c in claims)
    store._fetch = original  # type: ignore[method-assign]
    again = await store.claim_batch([request("a")], lease_s=30, retention_s=3600)
    assert not again[0].owned  # a new statement is not the lost one: a live lease elsewhere


async def test_an_attempt_count_and_a_give_back_sent_twice_count_once(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """record_attempt and give_back repeated (a reply lost after the commit) change the count
    once: the attempts reflect the runs, not the retries of a statement."""
    [claim] = await store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    fence = Fence("t.work", "k", claim.token or 0)
    for _ in range(2):
        assert await store.record_attempt(fence, attempt=2, error="boom", lease_s=30) == 2
    assert await db.fetchval("SELECT attempts FROM dedupe_claims") == 2
    for _ in range(2):
        assert await store.give_back(fence, attempt=2)
    assert await db.fetchval("SELECT attempts FROM dedupe_claims") == 1


async def test_a_heartbeat_after_the_give_back_does_not_hold_the_key_again(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A beat sent before a give-back (a parked retry, a graceful stop) and run after it finds
    the key handed back: it extends nothing, and the key stays free for its next copy."""
    [claim] = await store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    fence = Fence("t.work", "k", claim.token or 0)
    assert await store.heartbeat([(fence, 30.0)]) == {fence.ident}
    assert await store.give_back(fence, handed_back=True)
    assert await store.heartbeat([(fence, 30.0)]) == set()
    assert await db.fetchval("SELECT lease_until <= now() FROM dedupe_claims")
    [again] = await store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    assert again.owned and again.handed_back


async def test_a_heartbeat_after_a_taken_over_key_is_given_back_does_not_hold_it_again(
    store: ClaimStore, second_store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A key this worker took over from a dead one and gives back at a stop (Leases.give_back
    of a taken-over lease): a beat sent before the give-back and run after it extends nothing,
    as for any give-back, so the key is free at once; the key keeps its crash history (its next
    claim is still a take-over, whose run happens alone, and the history says taken_over)."""
    [dead] = await second_store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    await db.execute("UPDATE dedupe_claims SET lease_until = now() - interval '1 second'")
    [claim] = await store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    assert claim.owned and claim.taken_over and claim.token != dead.token
    fence = Fence("t.work", "k", claim.token or 0)
    assert await store.heartbeat([(fence, 30.0)]) == {fence.ident}
    lease = Lease(fence, 30.0, attempt=claim.attempts, counted=False, taken_over=True)
    await Leases(store).give_back(lease)
    assert await store.heartbeat([(fence, 30.0)]) == set()
    assert await db.fetchval("SELECT lease_until <= now() FROM dedupe_claims")
    [again] = await second_store.claim_batch([request("k")], lease_s=30, retention_s=3600)
    assert again.owned and again.taken_over and not again.handed_back
    events = await db.fetch("SELECT event FROM dedupe_claim_events ORDER BY at, id")
    assert [e["event"] for e in events if e["event"] != "attempt"][-2:] == [
        "taken_over",
        "taken_over",
    ]


# -- a failed COMMIT -------------------------------------------------------------------------


async def test_a_commit_that_fails_requeues_the_message_instead_of_dead_lettering_it(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The handler's transaction loses its connection at COMMIT (a deferred trigger ends the
    session once): under a narrow retry_on the message is requeued as a store failure, then
    completes once when it comes back (not dead-lettered as the handler's error)."""
    await db.execute(
        """
        CREATE TABLE effects (key text NOT NULL);
        -- A sequence, as its increments survive the rollback of the session it ends.
        CREATE SEQUENCE commit_fuse;
        CREATE FUNCTION blow_fuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('commit_fuse') = 1 THEN
                PERFORM pg_terminate_backend(pg_backend_pid());
            END IF;
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON effects
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION blow_fuse();
        """
    )
    calls: list[str] = []
    app = App("t")

    @app.handler(CH, lease_s=0.5, retry_on=(ValueError,))
    async def work(payload: Job, ctx: Context) -> None:
        calls.append(ctx.key)
        await ctx.db.execute("INSERT INTO effects VALUES ($1)", ctx.key)

    async with Processor(app, store) as processor:
        first = job("k")
        await processor.process(CH, [first])
        assert first.settlements[-1].action is Action.REQUEUE
        await asyncio.sleep(0.6)  # the requeued copy comes back once the lease has lapsed
        again = job("k")
        await processor.process(CH, [again])
        assert again.settlements[-1].action is Action.ACK
    assert calls == ["k", "k"]
    assert await db.fetchval("SELECT count(*) FROM effects") == 1
    assert await db.fetchval("SELECT status FROM dedupe_claims") == "completed"
