"""scripts/cluster.sh starts replicated services beside the single nodes: a PostgreSQL primary
with a streaming standby (synchronous or not), three RabbitMQ nodes in one cluster, three Kafka
KRaft brokers (RF 3, min.insync.replicas=2). Each is checked by what replication means: a write
seen on another node."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"
PG_BOTH = (
    "postgresql://dedupe:dedupe@127.0.0.1:5442,127.0.0.1:5443/dedupe"
    "?target_session_attrs=read-write"
)
PG_STANDBY = "postgresql://dedupe:dedupe@127.0.0.1:5443/dedupe"
AMQP = [f"amqp://guest:guest@127.0.0.1:{port}/" for port in (5681, 5682, 5683)]
KAFKA = "127.0.0.1:19092,127.0.0.1:19192,127.0.0.1:19292"


def _script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """Up for this module, down after it: the other tests keep the machine's two cores."""
    up = _script("up")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield
    finally:
        _script("down", timeout=300)


def test_up_is_idempotent_and_status_reports_each_cluster(cluster: None) -> None:
    again = _script("up", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "creating" not in again.stdout and "formatting" not in again.stdout, again.stdout
    status = _script("status", timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    for name in ("postgres", "rabbitmq", "kafka"):
        assert f"{name}: up" in status.stdout


async def test_postgresql_a_commit_on_the_primary_is_on_the_synchronous_standby(
    cluster: None,
) -> None:
    conn = await asyncpg.connect(PG_BOTH, ssl=False, timeout=10)
    standby = await asyncpg.connect(PG_STANDBY, ssl=False, timeout=10)
    try:
        assert await conn.fetchval("SELECT pg_is_in_recovery()") is False
        assert await standby.fetchval("SELECT pg_is_in_recovery()") is True
        state = await conn.fetchval(
            "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'dedupe_standby'"
        )
        assert state == "sync"
        table = f"t_{uuid.uuid4().hex[:8]}"
        await conn.execute(f"CREATE TABLE {table} (x int)")
        await conn.execute(f"INSERT INTO {table} VALUES (1)")
        # Synchronous commit waits for the standby's flush; its replay follows within moments.
        for _ in range(50):
            if (
                await standby.fetchval(f"SELECT to_regclass('{table}') IS NOT NULL")
                and await standby.fetchval(f"SELECT count(*) FROM {table}") == 1
            ):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the standby never replayed the primary's commit")
        await conn.execute(f"DROP TABLE {table}")
    finally:
        await conn.close()
        await standby.close()


async def test_postgresql_the_standby_can_be_made_asynchronous_and_back(cluster: None) -> None:
    async def state() -> str | None:
        conn = await asyncpg.connect(PG_BOTH, ssl=False, timeout=10)
        try:
            for _ in range(50):
                value: str | None = await conn.fetchval(
                    "SELECT sync_state FROM pg_stat_replication"
                    " WHERE application_name = 'dedupe_standby'"
                )
                if value == expected:
                    return value
                await asyncio.sleep(0.1)
            return value
        finally:
            await conn.close()

    try:
        assert _script("pg-sync", "off", timeout=60).returncode == 0
        expected = "async"
        assert await state() == "async"
    finally:
        assert _script("pg-sync", "on", timeout=60).returncode == 0
    expected = "sync"
    assert await state() == "sync"


async def test_rabbitmq_a_quorum_queue_declared_on_one_node_is_consumed_on_another(
    cluster: None,
) -> None:
    name = f"cluster-{uuid.uuid4().hex[:8]}"
    first = await aio_pika.connect(AMQP[0], timeout=10)
    try:
        channel = await first.channel(publisher_confirms=True)
        queue = await channel.declare_queue(
            name, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await channel.default_exchange.publish(aio_pika.Message(b"hello"), routing_key=name)
        third = await aio_pika.connect(AMQP[2], timeout=10)
        try:
            other = await third.channel()
            got = await (await other.get_queue(name, ensure=True)).get(timeout=10)
            assert got is not None and got.body == b"hello"
            await got.ack()
        finally:
            await third.close()
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await first.close()


async def test_kafka_a_topic_has_three_replicas_and_a_write_is_read_from_another_broker(
    cluster: None,
) -> None:
    topic = f"cluster-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(
        bootstrap_servers=KAFKA.split(",")[0], acks="all", enable_idempotence=True
    )
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"hello")
    finally:
        await producer.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA.split(",")[2])
    await admin.start()
    try:
        [description] = await admin.describe_topics([topic])
        assert {len(p["replicas"]) for p in description["partitions"]} == {3}, description
        assert {len(p["isr"]) for p in description["partitions"]} == {3}, description
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=KAFKA.split(",")[1], auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        got = await asyncio.wait_for(consumer.getone(), 30)
        assert got.value == b"hello"
    finally:
        await consumer.stop()


async def test_rabbitmq_a_worker_follows_the_cluster_when_its_node_stops(
    cluster: None, db_url: str, db: asyncpg.Connection
) -> None:
    """A worker on quorum queues with every node in its URL: the node it is connected to
    stops; it reconnects to another and finishes the stream, each effect once."""
    import dedupe_rabbitmq as rabbitmq
    from dedupe.claims.store import ClaimStore
    from dedupe_rabbitmq.transport import RabbitMQTransport
    from tests.conftest import eventually, running
    from tests.integration.test_reconnect import all_effects_once, effect_app, publish_stream

    nodes = ",".join(url.split("@", 1)[1].rstrip("/") for url in AMQP)
    url = f"amqp://guest:guest@{nodes}/?queue_type=quorum"
    channel = f"cluster-{uuid.uuid4().hex[:8]}"
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    await publish_stream(url, channel, 300)
    stopped: str | None = None
    transport = RabbitMQTransport(url)
    try:
        async with (
            ClaimStore.open(db_url, owner="w", max_size=5) as store,
            running(effect_app(channel), store, transport),
        ):

            async def some() -> bool:
                return bool(await db.fetchval("SELECT count(*) >= 30 FROM effects"))

            await eventually(some, timeout_s=30)
            connection = transport._connection
            assert connection is not None
            port = connection.url.port
            stopped = f"dedupe-c{(5681, 5682, 5683).index(port) + 1}@localhost"
            done = await asyncio.to_thread(_rabbitmqctl, stopped, "stop_app")
            assert done.returncode == 0, done.stdout + done.stderr
            await all_effects_once(db, 300)
            assert transport.reconnects >= 1
            now = transport._connection
            assert now is not None and not now.is_closed and now.url.port != port
            # What is published through the URL while that node is down is consumed too.
            await publish_stream(url, channel, 301)
            await all_effects_once(db, 301)
    finally:
        if stopped is not None:
            started = await asyncio.to_thread(_rabbitmqctl, stopped, "start_app")
            assert started.returncode == 0, started.stdout + started.stderr
        await rabbitmq.delete_channels(url, [channel])


def _rabbitmqctl(node: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rabbitmqctl", "-q", "-n", node, *args], capture_output=True, text=True, timeout=120
    )
