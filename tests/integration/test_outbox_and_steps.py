"""Effects beyond the database, on real services: ctx.publish goes through the outbox in the
completion transaction and is relayed with confirms; ctx.step runs once per key."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.records import ClaimRequest, Reason
from dedupe.claims.store import ClaimStore
from dedupe.claims.values import MAX_RESULT_BYTES
from dedupe.effects.run_effects import _NAMESPACE, StepError
from dedupe.errors import BrokerUnavailable
from dedupe.pipeline.processor import Processor
from dedupe.sql import queries
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action, Publisher
from dedupe_kafka import KafkaPublisher
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from tests.conftest import delete_channel_everywhere, eventually, running
from tests.integration.brokers import Broker

CH = "orders"


class Order(BaseModel):
    n: int


def order(key: str, n: int = 1) -> MemoryDelivery:
    return MemoryDelivery(make_message(CH, json.dumps({"n": n}), message_id=key))


class Recording:
    """A publisher that records what it was asked to send, failing the first `fail` times."""

    def __init__(self, fail: int = 0) -> None:
        self.sent: list[tuple[str, bytes, str, dict[str, str]]] = []
        self.fail = fail

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("broker refused (simulated)")
        self.sent.append((channel, body, message_id, dict(headers)))

    async def close(self) -> None:
        pass


def publishing_app(*, fail_first: bool = False, count: int = 1) -> App:
    app = App("shop")
    failed: set[str] = set()

    @app.handler(CH, backoff_s=0.01, max_backoff_s=0.01)
    async def place(payload: Order, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO orders VALUES ($1)", ctx.key)
        for i in range(count):
            await ctx.publish("emails", {"order": ctx.key, "i": i})
        if fail_first and ctx.key not in failed:
            failed.add(ctx.key)
            raise ValueError("the first attempt fails after publishing")

    return app


@pytest.fixture
async def orders(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE orders (key text NOT NULL)")
    return db


async def test_publishes_are_stored_with_the_writes_and_relayed_in_order(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """Five publishes of one run reach the publisher once each, in call order, with message ids
    derived from scope, key, channel and position; the rows are marked sent."""
    publisher = Recording()
    async with Processor(publishing_app(count=5), store, publisher=publisher) as processor:
        await processor.process(CH, [order("o-1")])

        async def relayed() -> bool:
            unsent = await orders.fetchval(
                "SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL"
            )
            return len(publisher.sent) == 5 and unsent == 0

        await eventually(relayed, timeout_s=10)
    assert [json.loads(body)["i"] for _, body, _, _ in publisher.sent] == [0, 1, 2, 3, 4]
    ids = [message_id for _, _, message_id, _ in publisher.sent]
    assert len(set(ids)) == 5
    assert {channel for channel, _, _, _ in publisher.sent} == {"emails"}
    unsent = await orders.fetchval("SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL")
    assert unsent == 0


async def test_a_failed_attempts_publishes_roll_back_and_the_retry_publishes_the_same_ids(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """The first attempt publishes, then fails: nothing of it is stored; the retry's publish
    carries the same message id (a re-run's copy is a duplicate downstream)."""
    publisher = Recording()
    async with Processor(publishing_app(fail_first=True), store, publisher=publisher) as p:
        delivery = order("o-2")
        await p.process(CH, [delivery])
        assert delivery.settlements[-1].action is Action.ACK

        async def relayed() -> bool:
            return len(publisher.sent) == 1

        await eventually(relayed, timeout_s=5)
    assert await orders.fetchval("SELECT count(*) FROM orders") == 1
    assert await orders.fetchval("SELECT count(*) FROM dedupe_outbox") == 1
    # The id a first attempt would have had too: derived, not random.
    assert publisher.sent[0][2] == str(uuid.uuid5(_NAMESPACE, "shop.place\x1fo-2\x1femails\x1f0"))


async def test_a_zombies_publishes_roll_back_with_its_writes(
    store: ClaimStore, db_url: str, orders: asyncpg.Connection
) -> None:
    """A run whose key was taken over publishes nothing: its completion is fenced and the
    outbox row goes with the rolled-back transaction."""
    app = App("shop")
    release, began = asyncio.Event(), asyncio.Event()

    @app.handler(CH, lease_s=0.5)
    async def place(payload: Order, ctx: Context) -> None:
        await ctx.publish("emails", {"order": ctx.key})
        began.set()
        await release.wait()

    publisher = Recording()
    async with Processor(app, store, publisher=publisher, heartbeat_s=3600) as zombie:
        delivery = order("o-3")
        running_task = asyncio.create_task(zombie.process(CH, [delivery]))
        await asyncio.wait_for(began.wait(), 10)  # claimed: the lease counts from here
        await asyncio.sleep(0.7)  # the lease lapses; no heartbeat
        async with ClaimStore.open(db_url, owner="other") as other:
            [taken] = await other.claim_batch(
                [ClaimRequest("shop.place", "o-3", delivery.message.payload_hash)],
                lease_s=30,
                retention_s=3600,
            )
            assert taken.owned and taken.taken_over
        release.set()
        await running_task
        assert delivery.settlements[-1].action is Action.DEFER  # lease lost
    assert await orders.fetchval("SELECT count(*) FROM dedupe_outbox") == 0
    assert publisher.sent == []


async def test_a_refused_publish_is_retried_counted_and_never_dropped(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """The broker refuses twice: the row is kept, its attempts counted, then sent."""
    publisher = Recording(fail=2)
    async with Processor(publishing_app(), store, publisher=publisher) as processor:
        assert processor.relay is not None
        processor.relay.interval_s = 0.05
        await processor.process(CH, [order("o-4")])

        async def marked_sent() -> bool:
            return bool(await orders.fetchval("SELECT sent_at IS NOT NULL FROM dedupe_outbox"))

        await eventually(marked_sent, timeout_s=10)
        assert processor.relay.stats.refused == 2
    assert len(publisher.sent) == 1
    assert await orders.fetchval("SELECT attempts FROM dedupe_outbox") == 2


class RefusingChannel(Recording):
    """A broker that refuses one channel for good (a topic it will not create, say)."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused
        self.tries = 0

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        if channel == self.refused:
            self.tries += 1
            raise ConnectionError("broker refused (simulated)")
        await super().publish(channel, body, message_id=message_id, headers=headers)


async def test_a_producer_stuck_on_a_refused_row_neither_stalls_the_others_nor_spins(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """A producer whose first row the broker refuses has more rows than a relay's round: the
    producers after it are relayed all the same, and the relay does not spin on it (before,
    every round took the stuck producer's later rows again, sent nothing and went straight on
    to the next round)."""
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing, Relay

    def row(producer: str, channel: str, i: int) -> Outgoing:
        return Outgoing(producer, channel, f"{producer}/{i}", b"{}", {}, None)

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [row("stuck", "refused", 0)], retention_s=60)
        await add_to_outbox(conn, [row("stuck", "emails", i) for i in range(1, 40)], retention_s=60)
        await add_to_outbox(conn, [row(f"p{i}", "emails", 0) for i in range(5)], retention_s=60)
    publisher = RefusingChannel("refused")
    async with Relay(store.pool, publisher, batch=8, interval_s=0.05) as relay:
        relay.wake()

        async def others_sent() -> bool:
            return len(publisher.sent) == 5

        await eventually(others_sent, timeout_s=5)
        await asyncio.sleep(0.5)
    assert sorted(m for _, _, m, _ in publisher.sent) == [f"p{i}/0" for i in range(5)]
    assert publisher.tries <= 3, f"the refused row was tried {publisher.tries} times in 1 s"
    assert relay.stats.refused == publisher.tries
    assert await orders.fetchval("SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL") == 40


async def test_a_relay_stopped_right_after_a_commit_relays_what_was_committed(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """Stopping, the relay still runs a round: rows committed before the stop go out (a worker
    that drains and stops leaves nothing for the next start)."""
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing, Relay

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [Outgoing("p", "emails", "p/0", b"{}", {}, None)], retention_s=60)
    publisher = Recording()
    async with Relay(store.pool, publisher, interval_s=30) as relay:
        relay.wake()
    assert [m for _, _, m, _ in publisher.sent] == ["p/0"]


class Holding(Recording):
    """A publisher whose first publish waits until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        if not self.started.is_set():
            self.started.set()
            await self.release.wait()
        await super().publish(channel, body, message_id=message_id, headers=headers)


async def test_a_stop_during_a_round_still_runs_a_round_after_it(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """Rows committed while a round is under way, before the stop, go out at the stop: the
    round that was under way is not the last (before, the relay returned after it)."""
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing, Relay

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [Outgoing("p", "emails", "p/0", b"{}", {}, None)], retention_s=60)
    publisher = Holding()
    relay = Relay(store.pool, publisher, interval_s=30)
    async with relay:
        relay.wake()
        await asyncio.wait_for(publisher.started.wait(), 5)
        async with store.pool.acquire() as conn, conn.transaction():
            await add_to_outbox(
                conn, [Outgoing("q", "emails", "q/0", b"{}", {}, None)], retention_s=60
            )
        stopping = asyncio.create_task(relay.__aexit__(None, None, None))
        await asyncio.sleep(0.1)
        publisher.release.set()
        await stopping
    assert sorted(m for _, _, m, _ in publisher.sent) == ["p/0", "q/0"]


class CancellingConfirms(Recording):
    """A client that cancels its pending confirm when its connection drops, once."""

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        if self.fail:
            self.fail -= 1
            raise asyncio.CancelledError()
        await super().publish(channel, body, message_id=message_id, headers=headers)


async def test_a_publish_cancelled_by_its_client_is_a_refusal_not_the_end_of_the_relay(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing, Relay

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [Outgoing("p", "emails", "p/0", b"{}", {}, None)], retention_s=60)
    publisher = CancellingConfirms(fail=1)
    async with Relay(store.pool, publisher, interval_s=0.05) as relay:
        relay.wake()

        async def sent() -> bool:
            return len(publisher.sent) == 1

        await eventually(sent, timeout_s=5)
    assert relay.stats.refused == 1


class UnreachableBroker(Recording):
    """A broker that cannot be reached for a while (a restart), then takes everything."""

    def __init__(self, down_for: int) -> None:
        super().__init__()
        self.down_for = down_for
        self.tries = 0

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        self.tries += 1
        if self.tries <= self.down_for:
            raise BrokerUnavailable("cannot connect to the broker (simulated)")
        await super().publish(channel, body, message_id=message_id, headers=headers)


async def test_a_broker_that_cannot_be_reached_refuses_no_row_and_costs_no_row_a_backoff(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """While the broker is down the rows stay due and uncounted (before, each try was a
    refusal: seven tries during a restart put the row 32 s, then 60 s, past the broker's
    return); the relay backs off as a whole and sends them once the broker is back."""
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing, Relay

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [Outgoing("p", "emails", "p/0", b"{}", {}, None)], retention_s=60)
    publisher = UnreachableBroker(down_for=7)
    async with Relay(store.pool, publisher, interval_s=0.01) as relay:
        relay.wake()

        async def sent() -> bool:
            return len(publisher.sent) == 1

        await eventually(sent, timeout_s=5)
    assert publisher.tries == 8
    assert relay.stats.refused == 0
    row = await orders.fetchrow("SELECT attempts, last_error, sent_at FROM dedupe_outbox")
    assert row is not None
    assert (row["attempts"], row["last_error"]) == (0, None) and row["sent_at"] is not None


class CountingKafka(KafkaPublisher):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.tries = 0

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str], **kw: Any
    ) -> None:
        self.tries += 1
        await super().publish(channel, body, message_id=message_id, headers=headers, **kw)


async def test_a_kafka_publisher_that_reaches_no_broker_says_broker_unavailable(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """The Kafka publisher turns aiokafka's connection errors into BrokerUnavailable, as
    RabbitMQ's does (before, KafkaConnectionError reached the relay as a refusal of the row:
    each try counted an attempt and pushed the row a growing backoff further)."""
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing, Relay

    with pytest.raises(BrokerUnavailable, match=r"cannot reach Kafka at 127\.0\.0\.1:1 "):
        async with KafkaPublisher("kafka://127.0.0.1:1") as unreachable:
            await unreachable.publish("emails", b"{}", message_id="x", headers={})

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(conn, [Outgoing("p", "emails", "p/0", b"{}", {}, None)], retention_s=60)
    publisher = CountingKafka("kafka://127.0.0.1:1")
    async with Relay(store.pool, publisher, interval_s=0.01) as relay:
        relay.wake()

        async def tried_twice() -> bool:
            return publisher.tries >= 2

        await eventually(tried_twice, timeout_s=10)
    await publisher.close()
    assert relay.stats.refused == 0
    row = await orders.fetchrow("SELECT attempts, last_error, sent_at FROM dedupe_outbox")
    assert row is not None
    assert (row["attempts"], row["last_error"], row["sent_at"]) == (0, None, None)


async def test_runs_that_only_publish_share_their_completion_transactions(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """A run whose only write is a publish costs no transaction of its own: the batch's
    completions and their outbox rows commit together (the rows of one transaction share
    its now()), and every row is relayed."""
    app = App("shop")

    @app.handler(CH)
    async def notify(payload: Order, ctx: Context) -> None:
        await ctx.publish("emails", {"order": ctx.key})

    publisher = Recording()
    async with Processor(app, store, publisher=publisher) as processor:
        await processor.process(CH, [order(f"o-{i}", i) for i in range(50)])

        async def relayed() -> bool:
            return len(publisher.sent) == 50

        await eventually(relayed, timeout_s=10)
    transactions = await orders.fetchval("SELECT count(DISTINCT created_at) FROM dedupe_outbox")
    assert transactions <= 10, f"{transactions} transactions for 50 runs"
    assert await orders.fetchval("SELECT count(*) FROM dedupe_outbox") == 50


@pytest.mark.parametrize(
    ("what", "publish"),
    [
        ("a NUL in the key", {"key": "a\x00b"}),
        ("a lone surrogate in the channel", {"channel": "emails\ud800"}),
        ("a NUL in a header", {"headers": {"x-note": "a\x00b"}}),
    ],
)
async def test_a_publish_the_outbox_cannot_store_is_an_error_at_the_call(
    store: ClaimStore, orders: asyncpg.Connection, what: str, publish: dict[str, Any]
) -> None:
    """A channel, key or header PostgreSQL cannot hold fails the attempt with a clear error
    (dead-lettered after its attempts), never a completion that fails again at each delivery."""
    app = App("shop")

    @app.handler(CH, max_attempts=2, backoff_s=0.01, max_backoff_s=0.01)
    async def notify(payload: Order, ctx: Context) -> None:
        options = dict(publish)
        await ctx.publish(options.pop("channel", "emails"), {"n": 1}, **options)

    async with Processor(app, store, publisher=Recording()) as processor:
        delivery = order("o-bad")
        await processor.process(CH, [delivery])
    outcome = delivery.settlements[-1]
    assert outcome.action is Action.DEAD_LETTER, (what, outcome)
    assert "ctx.publish" in (outcome.detail or "")
    assert await orders.fetchval("SELECT count(*) FROM dedupe_outbox") == 0


async def test_the_relays_take_costs_its_batch_not_the_backlog(
    orders: asyncpg.Connection,
) -> None:
    """Draining a large backlog, every round of the relay looks up the rows of the producers
    it took by index: it never scans the backlog (nor the sent rows kept for days), so a
    backlog drains in time proportional to its size."""
    await orders.execute(
        "INSERT INTO dedupe_outbox (producer, channel, message_id, body, sent_at, expires_at)"
        " SELECT 'p' || g, 'emails', 'm' || g, 'x', CASE WHEN g % 4 = 0 THEN now() END,"
        "        now() + interval '1 day'"
        "   FROM generate_series(1, 40000) AS g"
    )
    await orders.execute("ANALYZE dedupe_outbox")
    async with orders.transaction():
        plan = await orders.fetch("EXPLAIN " + queries("outbox.sql")["take"], 200)
    text = "\n".join(row[0] for row in plan)
    assert "Seq Scan on dedupe_outbox" not in text, text
    assert "Index Cond: (producer = " in text, text


async def test_a_second_relay_takes_the_next_producers_and_no_lock_beyond_its_batch(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """Two relays at once on one backlog: the second takes the producers after the first's
    (before, both tried the same first candidates, and the second took nothing and waited
    for its next wake), and each holds the advisory locks of the producers it took only."""
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(
            conn,
            [Outgoing(f"p{i}", "emails", f"p{i}/0", b"{}", {}, None) for i in range(20)],
            retention_s=60,
        )
    take = queries("outbox.sql")["take"]
    locks = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    async with store.pool.acquire() as one, one.transaction():
        first = [r["producer"] for r in await one.fetch(take, 5)]
        assert first == [f"p{i}" for i in range(5)]
        assert await one.fetchval(locks) == 5
        async with store.pool.acquire() as two, two.transaction():
            second = [r["producer"] for r in await two.fetch(take, 5)]
            assert second == [f"p{i}" for i in range(5, 10)]
            assert await two.fetchval(locks) == 5


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in _plan_nodes(child))]


async def test_a_round_reads_a_long_producers_batch_not_its_backlog(
    orders: asyncpg.Connection,
) -> None:
    """One producer with 20,000 unsent rows (a run that published that many) before 500
    others: a round reads its first rows up to the batch, not all of them (before, every
    round read the whole backlog of the producers it took, and sorted it)."""
    await orders.execute(
        "INSERT INTO dedupe_outbox (producer, channel, message_id, body, expires_at)"
        " SELECT CASE WHEN g <= 20000 THEN 'long' ELSE 'p' || g END, 'emails', 'm' || g, 'x',"
        "        now() + interval '1 day'"
        "   FROM generate_series(1, 20500) AS g"
    )
    await orders.execute("ANALYZE dedupe_outbox")
    async with orders.transaction():
        [plan] = json.loads(
            await orders.fetchval(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + queries("outbox.sql")["take"], 200
            )
        )
    read = [
        (node["Node Type"], node["Actual Rows"] * node["Actual Loops"])
        for node in _plan_nodes(plan["Plan"])
        if node.get("Relation Name") == "dedupe_outbox"
    ]
    # At most the window (4 rounds' worth of the oldest due rows) by any scan.
    assert read and max(rows for _, rows in read) <= 4 * 200, read


async def test_a_round_locks_the_rows_it_relays_only(orders: asyncpg.Connection) -> None:
    """200 producers with 300 unsent rows each: a round of 200 locks its 200 rows (before, the
    read of each producer's chain locked up to 200 rows of each, 40,000 in all, rewritten in
    every round)."""
    await orders.execute(
        "INSERT INTO dedupe_outbox (producer, channel, message_id, body, expires_at)"
        " SELECT 'p' || (g % 200), 'emails', 'm' || g, 'x', now() + interval '1 day'"
        "   FROM generate_series(1, 60000) AS g"
    )
    await orders.execute("ANALYZE dedupe_outbox")
    async with orders.transaction():
        taken = await orders.fetch(queries("outbox.sql")["take"], 200)
        locked = await orders.fetchval(
            "SELECT count(*) FROM dedupe_outbox WHERE xmax::text = txid_current()::text"
        )
    assert len(taken) == 200
    assert [r["id"] for r in taken] == sorted(r["id"] for r in taken)
    assert locked == 200, locked


async def test_a_producer_waiting_out_a_refusal_is_not_locked_by_a_round(
    store: ClaimStore, orders: asyncpg.Connection
) -> None:
    """The advisory locks are tried on the producers that can go only: one whose first row
    waits out a backoff, with later rows in the window, is neither taken nor locked."""
    from dedupe.claims.completion import add_to_outbox
    from dedupe.effects.outbox import Outgoing

    async with store.pool.acquire() as conn, conn.transaction():
        await add_to_outbox(
            conn,
            [Outgoing("waiting", "emails", f"w/{i}", b"{}", {}, None) for i in range(3)],
            retention_s=60,
        )
        await add_to_outbox(
            conn, [Outgoing("ready", "emails", "r/0", b"{}", {}, None)], retention_s=60
        )
    await orders.execute(
        "UPDATE dedupe_outbox SET next_try_at = now() + interval '1 hour' WHERE message_id = 'w/0'"
    )
    async with orders.transaction():
        taken = [r["producer"] for r in await orders.fetch(queries("outbox.sql")["take"], 10)]
        locks = await orders.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
    assert taken == ["ready"]
    assert locks == 1


def real_publisher(broker: Broker) -> Publisher:
    url = getattr(broker, "url")  # noqa: B009
    return KafkaPublisher(url) if broker.name == "kafka" else RabbitMQPublisher(url)


@pytest.fixture
async def second(request: pytest.FixtureRequest, channel: str) -> AsyncIterator[str]:
    """A second channel of the test's own, deleted at the end."""
    name = f"{channel}-b"
    yield name
    await delete_channel_everywhere(request, name)


async def test_a_two_stage_chain_runs_each_stage_once_on_the_broker(
    broker: Broker, channel: str, second: str, store: ClaimStore, db: asyncpg.Connection
) -> None:
    """Stage A writes and publishes to stage B through the outbox; every order has one effect
    at each stage, and a relay repeat (the rows sent again) is a duplicate for B."""
    await db.execute("CREATE TABLE effects (stage text NOT NULL, key text NOT NULL)")
    app = App("chain")

    @app.handler(channel)
    async def stage_a(payload: Order, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ('a', $1)", ctx.key)
        await ctx.publish(second, {"n": payload.n})

    @app.handler(second)
    async def stage_b(payload: Order, ctx: Context) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ('b', $1)", str(payload.n))

    publisher = real_publisher(broker)
    try:
        await broker.publish(
            channel, [(json.dumps({"n": i}).encode(), {}, f"k{i}") for i in range(20)]
        )
        async with running(app, store, broker.transport(), publisher=publisher) as worker:

            async def both_stages() -> bool:
                return worker.stats.completed == 40

            await eventually(both_stages, timeout_s=30)
            await db.execute("UPDATE dedupe_outbox SET sent_at = NULL")  # a relay repeat

            async def repeated() -> bool:
                return worker.stats.duplicates == 20

            await eventually(repeated, timeout_s=30)
        rows = await db.fetch("SELECT stage, count(*) AS n FROM effects GROUP BY stage")
        assert {r["stage"]: r["n"] for r in rows} == {"a": 20, "b": 20}
        assert await db.fetchval("SELECT count(DISTINCT key) FROM effects WHERE stage = 'b'") == 20
    finally:
        await publisher.close()


# -- durable steps ---------------------------------------------------------------------------


def stepping_app(calls: list[str], *, fail_after_step: int = 0, sync: bool = False) -> App:
    app = App("pay")
    failures = {"left": fail_after_step}

    def provider_sync(amount: int, *, idempotency_key: str) -> dict[str, Any]:
        calls.append(idempotency_key)
        return {"charge": f"ch_{len(calls)}", "amount": amount}

    async def provider(amount: int, *, idempotency_key: str) -> dict[str, Any]:
        return provider_sync(amount, idempotency_key=idempotency_key)

    @app.handler(CH, backoff_s=0.01, max_backoff_s=0.01, max_attempts=3, retry_on=(ValueError,))
    async def charge(payload: Order, ctx: Context) -> dict[str, Any]:
        fn = provider_sync if sync else provider
        result = await ctx.step("charge", fn, payload.n, idempotency_key=f"{ctx.key}/charge")
        if failures["left"]:
            failures["left"] -= 1
            raise ValueError("the e-mail step failed")
        return result  # type: ignore[no-any-return]

    return app


@pytest.mark.parametrize("sync", [False, True], ids=["async fn", "sync fn"])
async def test_a_step_runs_once_across_retries(store: ClaimStore, sync: bool) -> None:
    """Two attempts fail after the step: the provider is called once, and the result the
    handler returns at last is the one recorded by the first attempt."""
    calls: list[str] = []
    async with Processor(stepping_app(calls, fail_after_step=2, sync=sync), store) as p:
        delivery = order("p-1", 700)
        await p.process(CH, [delivery])
    assert calls == ["p-1/charge"]
    outcome = delivery.settlements[-1]
    assert outcome.action is Action.ACK
    assert json.loads(outcome.result or "null") == {"charge": "ch_1", "amount": 700}


async def test_a_steps_record_outlives_a_failure_a_release_and_the_rerun(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The key fails for good after its step; an operator releases it; the re-run does not
    charge again (step records survive claims release and dlq replay)."""
    calls: list[str] = []
    async with Processor(stepping_app(calls, fail_after_step=3), store) as p:
        first = order("p-2", 5)
        await p.process(CH, [first])
        assert first.settlements[-1].reason is Reason.MAX_ATTEMPTS
    assert await store.release("pay.charge", "p-2") == "failed"
    async with Processor(stepping_app(calls), store) as p:
        again = order("p-2", 5)
        await p.process(CH, [again])
        assert again.settlements[-1].action is Action.ACK
    assert calls == ["p-2/charge"]
    assert await db.fetchval("SELECT count(*) FROM dedupe_steps") == 1


async def test_a_step_result_that_is_not_json_is_an_error_at_the_call(store: ClaimStore) -> None:
    """A step returning an object JSON cannot hold fails the attempt with a clear error."""
    app = App("pay")

    @app.handler(CH, retry_on=())
    async def charge(payload: Order, ctx: Context) -> None:
        await ctx.step("charge", lambda: object())

    async with Processor(app, store) as p:
        delivery = order("p-3")
        await p.process(CH, [delivery])
    outcome = delivery.settlements[-1]
    assert outcome.reason is Reason.HANDLER_ERROR
    assert "must be JSON" in (outcome.detail or "")
    assert StepError.__name__ in (outcome.detail or "")


async def test_a_step_result_with_a_nul_is_stored_mended_and_the_same_on_every_attempt(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A step returning text the database cannot hold (NUL, a lone surrogate) records it with
    U+FFFD in their place, and the first run gets what later attempts get; before, the record
    failed as 'claim store unavailable' and the provider was called again at every delivery."""
    calls: list[str] = []
    seen: list[Any] = []
    app = App("pay")

    @app.handler(CH, max_attempts=3, backoff_s=0.01)
    async def charge(payload: Order, ctx: Context) -> None:
        def provider() -> dict[str, str]:
            calls.append(ctx.key)
            return {"id": "ch\x00\ud800x"}

        seen.append(await ctx.step("charge", provider))
        if ctx.attempt == 1:
            raise RuntimeError("the run fails after its step")

    async with Processor(app, store) as p:
        delivery = order("p-nul")
        await p.process(CH, [delivery])  # attempt 1 fails after its step; attempt 2 completes
        assert delivery.settlements[-1].action is Action.ACK
    assert calls == ["p-nul"]
    assert seen == [{"id": "ch\ufffd\ufffdx"}] * 2
    assert await db.fetchval("SELECT result->>'id' FROM dedupe_steps") == "ch\ufffd\ufffdx"


async def test_a_large_step_result_is_kept_and_every_attempt_gets_it_as_stored(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A step's result over a handler result's limit (1 MiB) is kept whole: the step ran, so
    refusing it would call the provider again. The first run gets what jsonb kept (its number
    spelling, its key order), as every later attempt does."""
    calls: list[str] = []
    seen: list[Any] = []
    app = App("pay")

    @app.handler(CH, max_attempts=3, backoff_s=0.01)
    async def charge(payload: Order, ctx: Context) -> None:
        def provider() -> dict[str, Any]:
            calls.append(ctx.key)
            return {"receipt": "r" * (MAX_RESULT_BYTES + 1), "amount": 1e16}

        got = await ctx.step("charge", provider)
        seen.append((len(got["receipt"]), got["amount"], type(got["amount"]).__name__))
        if ctx.attempt == 1:
            raise RuntimeError("the run fails after its step")

    async with Processor(app, store) as p:
        delivery = order("p-big")
        await p.process(CH, [delivery])
        assert delivery.settlements[-1].action is Action.ACK
    assert calls == ["p-big"]
    assert len(seen) == 2
    assert seen[0] == seen[1], seen


async def test_a_zombies_step_is_refused_and_not_trusted_by_the_next_owner(
    store: ClaimStore, db_url: str, db: asyncpg.Connection
) -> None:
    """A run frozen past its lease is taken over; its step after that is refused by the fence
    (the zombie's run ends as lease lost) and nothing it would record is kept."""
    app = App("pay")
    thaw, began = asyncio.Event(), asyncio.Event()
    calls: list[str] = []

    @app.handler(CH, lease_s=0.5)
    async def charge(payload: Order, ctx: Context) -> None:
        began.set()
        await thaw.wait()
        await ctx.step("charge", lambda: calls.append(ctx.key) or {"ok": True})

    async with Processor(app, store, heartbeat_s=3600) as zombie:
        delivery = order("p-4")
        task = asyncio.create_task(zombie.process(CH, [delivery]))
        await asyncio.wait_for(began.wait(), 10)  # claimed: the lease counts from here
        await asyncio.sleep(0.7)
        async with ClaimStore.open(db_url, owner="other") as other:
            [taken] = await other.claim_batch(
                [ClaimRequest("pay.charge", "p-4", delivery.message.payload_hash)],
                lease_s=30,
                retention_s=3600,
            )
            assert taken.owned
        thaw.set()
        await task
        assert delivery.settlements[-1].action is Action.DEFER
        assert zombie.stats.lease_lost == 1
    assert calls == []  # the fence is looked at before the step's function is called
    assert await db.fetchval("SELECT count(*) FROM dedupe_steps") == 0
