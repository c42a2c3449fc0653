"""The RabbitMQ consumer on aiormq, against the real broker: what a delivery's frame carries
reaches the Message, acks go out in multiple runs that never pass a delivery still running,
and after a broker restart or a cut connection the consumer connects again, declares its
queues again and resumes, with every key's effect once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
import asyncpg
import pytest
from aiormq.abc import AbstractChannel

import dedupe_rabbitmq as rabbitmq
import dedupe_rabbitmq.transport as transport_module
from dedupe import App, Reject
from dedupe.claims.store import ClaimStore
from dedupe.message import Message
from dedupe.transport import ACK, Action, Delivery, Settlement, dlq_name
from dedupe_rabbitmq.topology import declare_channel, delay_name
from dedupe_rabbitmq.transport import RabbitMQTransport
from tests.chaos.faults import _command
from tests.conftest import eventually, running
from tests.integration.test_reconnect import (
    Job,
    all_effects_once,
    effect_app,
    publish_stream,
    queue_state,
)

Settle = Callable[[Delivery], Awaitable[None]]


def polled(check: Callable[[], object]) -> Callable[[], Awaitable[object]]:
    """An `eventually` predicate of a plain check."""

    async def predicate() -> object:
        return check()

    return predicate


async def ack(delivery: Delivery) -> None:
    await delivery.settle(ACK)


@contextlib.asynccontextmanager
async def serving(
    transport: RabbitMQTransport, channel: str, settle: Settle
) -> AsyncIterator[list[Message]]:
    """The transport alone, no core: each delivery's message is recorded, then `settle`d."""
    seen: list[Message] = []

    async def process(name: str, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            seen.append(delivery.message)
        await asyncio.gather(*(settle(delivery) for delivery in deliveries))

    async with consuming(transport, channel, process):
        yield seen


@contextlib.asynccontextmanager
async def consuming(
    transport: RabbitMQTransport,
    channel: str,
    process: Callable[[str, Sequence[Delivery]], Awaitable[None]],
) -> AsyncIterator[None]:
    """The transport alone, serving `process`, until the block ends; then closed."""
    stop = asyncio.Event()
    task = asyncio.create_task(transport.serve([channel], process, stop))
    try:
        yield
    finally:
        stop.set()
        await task
        await transport.close()


class HeldBatches:
    """A `process` that records each batch's size and acks it; after `hold_next()` the next
    batch waits until `release()` (or the end of the `async with`)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._holding = False
        self._released = asyncio.Event()

    def hold_next(self) -> None:
        self._holding, self._released = True, asyncio.Event()

    def release(self) -> None:
        self._released.set()

    @property
    def held(self) -> bool:
        return not self._released.is_set()

    async def __call__(self, name: str, deliveries: Sequence[Delivery]) -> None:
        self.sizes.append(len(deliveries))
        if self._holding:
            self._holding = False
            await self._released.wait()
        await asyncio.gather(*(delivery.settle(ACK) for delivery in deliveries))

    async def __aenter__(self) -> HeldBatches:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


async def exists(amqp_url: str, name: str) -> bool:
    try:
        await queue_state(amqp_url, name)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    return True


async def delete_queues(amqp_url: str, *names: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        amqp = await connection.channel()
        for name in names:
            await amqp.queue_delete(name)


class Proxy:
    """A TCP relay to the broker whose connections the test can cut (a killed socket: no
    AMQP close, the worker only sees its socket end) and whose port it can close for a while."""

    def __init__(self) -> None:
        self.accepting = True
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.connections = 0

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"amqp://guest:guest@127.0.0.1:{port}/"

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            writer.transport.abort()
            return
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 5672)
        self.writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        """Abort every relayed socket, on both sides."""
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()


async def publish_more(amqp_url: str, channel: str, numbers: range) -> None:
    """Keys k<n> for n in `numbers`, as publish_stream publishes k0, k1, ..."""
    await rabbitmq.publish(
        amqp_url, channel, [(json.dumps({"n": i}).encode(), {}, f"k{i}") for i in numbers]
    )


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dedupe_rabbitmq.transport" and text in r.getMessage()
    ]


# -- the envelope ---------------------------------------------------------------------------


async def test_a_deliverys_headers_and_properties_reach_the_message(
    amqp_url: str, channel: str
) -> None:
    """Headers (any case, any AMQP type) and every property set on the publish come out of the
    frame into the Message: body, message id, content type, attempt, and the rest in meta."""
    stamp = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        amqp = await connection.channel(publisher_confirms=True)
        await declare_channel(amqp, channel)
        await amqp.default_exchange.publish(
            aio_pika.Message(
                b'{"n": 1}',
                headers={
                    "X-Tenant": "acme",
                    "x-count": 7,
                    "x-raw": bytearray(b"bytes"),
                    "x-dedupe-deferrals": 2,
                },
                message_id="m-1",
                correlation_id="c-1",
                reply_to="nowhere",
                content_type="application/json",
                content_encoding="utf-8",
                timestamp=stamp,
                type="order.created",
                app_id="shop",
                priority=3,
            ),
            routing_key=channel,
        )

    async with serving(RabbitMQTransport(amqp_url), channel, ack) as seen:
        await eventually(polled(lambda: seen))
    [message] = seen
    assert (message.channel, message.body, message.message_id) == (channel, b'{"n": 1}', "m-1")
    assert message.content_type == "application/json"
    assert message.attempt == 3  # deferred twice before
    assert message.headers["x-tenant"] == "acme"
    assert (message.headers["X-COUNT"], message.headers["x-raw"]) == ("7", "bytes")
    meta = dict(message.meta)
    assert meta.pop("delivery_tag") >= 1
    timestamp = meta.pop("timestamp")
    assert timestamp.replace(tzinfo=UTC) == stamp
    assert meta == {
        "redelivered": False,
        "exchange": "",
        "routing_key": channel,
        "correlation_id": "c-1",
        "reply_to": "nowhere",
        "type": "order.created",
        "app_id": "shop",
        "priority": 3,
        "content_encoding": "utf-8",
        "delivery_mode": 1,
    }
    assert await queue_state(amqp_url, channel) == (0, 0)


# -- acks -----------------------------------------------------------------------------------


async def test_acks_go_out_in_multiple_runs_requeues_alone_and_the_queue_drains(
    amqp_url: str, channel: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """300 messages, every tenth requeued once: far fewer ack frames than messages, some of
    them multiple, every nack single; each message acked once and the channel never lost (a
    multiple-ack over a tag nacked later would make the broker close it)."""
    frames: list[tuple[str, int, bool]] = []
    basic_ack, basic_nack = aiormq.Channel.basic_ack, aiormq.Channel.basic_nack

    async def ack_spy(self: aiormq.Channel, tag: int, multiple: bool = False, **kw: Any) -> None:
        frames.append(("ack", tag, multiple))
        await basic_ack(self, tag, multiple, **kw)

    async def nack_spy(self: aiormq.Channel, tag: int, multiple: bool = False, **kw: Any) -> None:
        frames.append(("nack", tag, multiple))
        await basic_nack(self, tag, multiple, **kw)

    monkeypatch.setattr(aiormq.Channel, "basic_ack", ack_spy)
    monkeypatch.setattr(aiormq.Channel, "basic_nack", nack_spy)
    caplog.set_level(logging.WARNING, logger="dedupe_rabbitmq.transport")
    count = 300
    await publish_stream(amqp_url, channel, count)
    acked: list[str] = []

    async def settle(delivery: Delivery) -> None:
        message = delivery.message
        key = message.message_id or ""
        if int(key[1:]) % 10 == 0 and not message.meta["redelivered"]:
            await delivery.settle(Settlement(Action.REQUEUE))
            return
        await asyncio.sleep(0.001 * (hash(key) % 5))  # settled out of order
        acked.append(key)
        await delivery.settle(ACK)

    async with serving(RabbitMQTransport(amqp_url, prefetch=50, batch_max=50), channel, settle):
        await eventually(polled(lambda: len(acked) == count), timeout_s=30)
        await asyncio.sleep(0.2)
    assert sorted(acked) == sorted(f"k{i}" for i in range(count))
    assert await queue_state(amqp_url, channel) == (0, 0)  # nothing left unacked at the close
    acks = [f for f in frames if f[0] == "ack"]
    nacks = [f for f in frames if f[0] == "nack"]
    assert len(nacks) == count // 10 and not any(multiple for _, _, multiple in nacks)
    assert any(multiple and tag > 1 for _, tag, multiple in acks)
    assert len(acks) < count / 2
    assert not lines(caplog, "lost the RabbitMQ")


async def test_a_delivery_still_running_is_not_acked_by_the_multiple_ack_of_later_ones(
    amqp_url: str, channel: str
) -> None:
    """The first delivery never settles while 49 after it do: when the consumer closes, the
    broker still holds it unacked and gives it back (redelivered); the others are gone."""
    await publish_stream(amqp_url, channel, 50)
    done: list[str] = []

    async def settle(delivery: Delivery) -> None:
        if delivery.message.message_id != "k0":
            await delivery.settle(ACK)
            done.append(delivery.message.message_id or "")

    async with serving(RabbitMQTransport(amqp_url), channel, settle):
        await eventually(polled(lambda: len(done) == 49))
        await asyncio.sleep(0.3)  # past the late single acks
    assert await queue_state(amqp_url, channel) == (1, 0)
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        amqp = await connection.channel()
        queue = await amqp.get_queue(channel)
        left = await queue.get(timeout=5)
        assert (left.message_id, left.redelivered) == ("k0", True)


# -- reconnects -----------------------------------------------------------------------------


async def test_the_consumer_resumes_after_a_broker_restart_and_runs_each_key_once(
    amqp_url: str,
    channel: str,
    db_url: str,
    db: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """rabbitmqctl stop_app / start_app mid-stream: the worker connects again (with backoff
    while the node is down), consumes again, and every key's effect happens once."""
    caplog.set_level(logging.INFO, logger="dedupe_rabbitmq.transport")
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    await publish_stream(amqp_url, channel, 300)
    transport = RabbitMQTransport(amqp_url)
    async with (
        ClaimStore.open(db_url, owner="w", max_size=10) as store,
        running(effect_app(channel), store, transport),
    ):

        async def some() -> bool:
            return bool(await db.fetchval("SELECT count(*) >= 50 FROM effects"))

        await eventually(some)
        try:
            await _command("rabbitmqctl", "-q", "stop_app")()
            await asyncio.sleep(1.0)
        finally:
            await _command("rabbitmqctl", "-q", "start_app")()
        await eventually(polled(lambda: transport.reconnects >= 1), timeout_s=30)
        await publish_more(amqp_url, channel, range(300, 400))  # consumed after the restart
        await all_effects_once(db, 400)
    assert lines(caplog, "lost the RabbitMQ connection")
    assert lines(caplog, "reconnected to RabbitMQ")


async def test_a_killed_socket_is_followed_by_a_reconnect_that_declares_the_queues_again(
    amqp_url: str,
    channel: str,
    db_url: str,
    db: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker's socket dies without an AMQP close and the port refuses it for a second,
    while an operator deletes the channel's dead-letter and delay queues: it connects again,
    declares them again, consumes again, and every key's effect happens once."""
    caplog.set_level(logging.INFO, logger="dedupe_rabbitmq.transport")
    await db.execute("CREATE TABLE effects (key text NOT NULL)")
    await publish_stream(amqp_url, channel, 300)
    async with Proxy() as proxy:
        transport = RabbitMQTransport(proxy.url)
        async with (
            ClaimStore.open(db_url, owner="w", max_size=10) as store,
            running(effect_app(channel), store, transport),
        ):

            async def some() -> bool:
                return bool(await db.fetchval("SELECT count(*) >= 50 FROM effects"))

            await eventually(some)
            proxy.accepting = False
            proxy.cut()
            await delete_queues(amqp_url, dlq_name(channel), delay_name(channel))
            await asyncio.sleep(1.0)
            proxy.accepting = True
            await eventually(polled(lambda: transport.reconnects == 1), timeout_s=30)
            await publish_more(amqp_url, channel, range(300, 400))
            await all_effects_once(db, 400)
            assert transport.reconnects == 1
            assert await exists(amqp_url, dlq_name(channel))
            assert await exists(amqp_url, delay_name(channel))
            assert (await queue_state(amqp_url, channel))[1] == 1  # consumed again, once
    assert lines(caplog, "could not consume from RabbitMQ again")  # refused while cut
    assert lines(caplog, "reconnected to RabbitMQ")


async def test_dead_letters_still_go_out_after_the_broker_closed_the_connection(
    amqp_url: str, channel: str, store: ClaimStore
) -> None:
    """RabbitMQ closes the worker's connection (rabbitmqctl close_connection, as
    close_all_connections does to every one): the copies' channel comes back on the new
    connection, so a poison message published afterwards still reaches <channel>.dlq."""
    app = App("t")

    @app.handler(channel)
    async def work(payload: Job) -> None:
        raise Reject("poison")

    name = f"dedupe-test-{uuid.uuid4().hex[:8]}"
    transport = RabbitMQTransport(amqp_url, connection_name=name)
    async with running(app, store, transport):
        await eventually(polled(lambda: transport.copies.channel is not None))
        listing = await asyncio.to_thread(
            subprocess.run,
            ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        ours = [line.split("\t")[0] for line in listing.stdout.splitlines() if name in line]
        assert len(ours) == 1, "the worker has one connection, for consuming and copies"
        await _command("rabbitmqctl", "-q", "close_connection", ours[0], "test: cut")()
        await eventually(polled(lambda: transport.reconnects == 1))
        await rabbitmq.publish(amqp_url, channel, [(json.dumps({"n": 1}).encode(), {}, "p1")])

        async def dead_lettered() -> bool:
            return len(await rabbitmq.peek_dead_letters(amqp_url, channel, limit=10)) == 1

        await eventually(dead_lettered, timeout_s=20)
    [letter] = await rabbitmq.peek_dead_letters(amqp_url, channel, limit=10)
    assert (letter["key"], letter["reason"]) == ("p1", "rejected")


async def test_while_batches_run_the_next_one_gathers_what_arrives_and_a_lone_one_goes_at_once(
    amqp_url: str, channel: str
) -> None:
    """RabbitMQ sends as many deliveries as acks free: handed over the moment they arrive,
    batches stay as small as the acks that freed them. With `batches_in_flight=1`, the next
    batch gathers while one runs and goes when it ends; one that never ends holds the next back
    GATHER_S at most; a delivery with nothing running goes at once."""
    transport = RabbitMQTransport(f"{amqp_url}?batches_in_flight=1", prefetch=100, batch_max=100)
    transport.GATHER_S = 30.0  # nothing below waits for it unless the gathering is wrong
    batches = HeldBatches()

    def arrived() -> int:
        return len(transport._inboxes[channel].frames)

    async with consuming(transport, channel, batches), batches, asyncio.timeout(20):
        # A lone delivery goes at once (it would wait 30 s if it gathered), and is held.
        batches.hold_next()
        await publish_more(amqp_url, channel, range(1))
        await eventually(polled(lambda: batches.sizes == [1]), timeout_s=5)
        # 40 more arrive while it runs: they gather, and go as one batch when it ends.
        await publish_more(amqp_url, channel, range(1, 41))
        await eventually(polled(lambda: arrived() == 40), timeout_s=5)
        assert batches.sizes == [1]
        batches.release()
        await eventually(polled(lambda: batches.sizes == [1, 40]), timeout_s=5)
        # A batch that never ends holds the next one back GATHER_S at most.
        transport.GATHER_S = 0.5
        batches.hold_next()
        await publish_more(amqp_url, channel, range(41, 42))
        await eventually(polled(lambda: batches.sizes == [1, 40, 1]), timeout_s=5)
        await publish_more(amqp_url, channel, range(42, 52))
        await eventually(polled(lambda: batches.sizes == [1, 40, 1, 10]), timeout_s=5)
        assert batches.held
    assert await queue_state(amqp_url, channel) == (0, 0)


async def test_a_batch_stops_gathering_once_the_prefetch_window_is_taken(
    amqp_url: str, channel: str
) -> None:
    """prefetch 10, one batch in flight: while a batch of 1 runs (unacked), only 9 more can
    come; once they are there the gathering batch goes at once, not after GATHER_S."""
    transport = RabbitMQTransport(f"{amqp_url}?batches_in_flight=1", prefetch=10, batch_max=10)
    transport.GATHER_S = 30.0
    batches = HeldBatches()
    async with consuming(transport, channel, batches), batches, asyncio.timeout(20):
        batches.hold_next()
        await publish_more(amqp_url, channel, range(1))
        await eventually(polled(lambda: batches.sizes == [1]), timeout_s=5)
        await publish_more(amqp_url, channel, range(1, 21))
        await eventually(polled(lambda: batches.sizes == [1, 9]), timeout_s=5)
        batches.release()
        await eventually(polled(lambda: sum(batches.sizes) == 21), timeout_s=10)
    assert await queue_state(amqp_url, channel) == (0, 0)


async def test_a_channel_lost_while_the_consumer_starts_is_consumed_on_again(
    amqp_url: str, channel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consuming channel closes while serve() declares its queues (a broker restarting at
    that moment): the start goes on as after any loss, on a new channel, instead of failing."""
    original = transport_module.declare_queues
    declared: list[str] = []

    async def closing_the_first(amqp: AbstractChannel, name: str, **options: Any) -> None:
        declared.append(name)
        if len(declared) == 1:
            await amqp.close()
        await original(amqp, name, **options)

    monkeypatch.setattr(transport_module, "declare_queues", closing_the_first)
    async with serving(RabbitMQTransport(amqp_url), channel, ack) as seen:
        await publish_more(amqp_url, channel, range(5))
        await eventually(polled(lambda: len(seen) == 5), timeout_s=10)
    assert len(declared) >= 2
    assert await queue_state(amqp_url, channel) == (0, 0)
