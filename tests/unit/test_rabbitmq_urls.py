"""An AMQP URL that lists several nodes and carries `?queue_type=`: parsed into one client URL
per node (in order, our options taken out), the queue arguments the type adds, and the one
connect function that tries the nodes in order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiormq.exceptions import AMQPConnectionError

from dedupe.errors import ConfigurationError
from dedupe.plugins import transport_plugin
from dedupe_rabbitmq.connection import connect
from dedupe_rabbitmq.options import DELIVERY_LIMIT, BrokerUrl, RabbitOptions
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_rabbitmq.topology import queues
from dedupe_rabbitmq.transport import RabbitMQTransport


def test_one_client_url_per_node_in_the_order_written() -> None:
    url = "amqp://u:p%40ss@rabbit1:5672,rabbit2,[::1]:5673/prod?heartbeat=30&queue_type=quorum"
    parsed = BrokerUrl.parse(url)
    assert parsed.nodes == (
        "amqp://u:p%40ss@rabbit1:5672/prod?heartbeat=30",
        "amqp://u:p%40ss@rabbit2/prod?heartbeat=30",
        "amqp://u:p%40ss@[::1]:5673/prod?heartbeat=30",
    )
    assert parsed.options.queue_type == "quorum"


def test_a_single_node_url_is_left_as_it_was_and_classic_is_the_default() -> None:
    for url in ("amqp://guest:guest@127.0.0.1:5672/", "amqps://h/%2F?heartbeat=5", "amqp://h"):
        parsed = BrokerUrl.parse(url)
        assert parsed.nodes == (url,)
        assert parsed.options == RabbitOptions(queue_type="classic")


def test_a_wrong_queue_type_or_an_empty_node_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="did you mean 'quorum'"):
        BrokerUrl.parse("amqp://h/?queue_type=qourum")
    with pytest.raises(ConfigurationError, match="empty node"):
        BrokerUrl.parse("amqp://g:g@h1:5672,,h2:5672/")
    with pytest.raises(ConfigurationError, match="queue_type"):
        RabbitMQTransport("amqp://h/?queue_type=stream")  # checked before any connection
    with pytest.raises(ConfigurationError, match="queue_type"):
        RabbitMQPublisher("amqp://h/?queue_type=stream")


def test_quorum_queues_get_an_explicit_delivery_limit_and_dead_letter_at_least_once() -> None:
    classic = dict(queues("c"))
    assert classic["c.dlq"] is None
    assert "x-queue-type" not in (classic["c"] or {})  # unchanged for existing users
    quorum = dict(queues("c", RabbitOptions(queue_type="quorum")))
    assert set(quorum) == set(classic)
    for name, arguments in quorum.items():
        assert arguments is not None
        assert arguments["x-queue-type"] == "quorum", name
        # Well above any max_attempts, and never -1 (RabbitMQ 3.x: over the limit at once).
        assert arguments["x-delivery-limit"] == DELIVERY_LIMIT >= 1000, name
        # Everything classic had is kept (dead-letter targets).
        assert (classic[name] or {}).items() <= arguments.items(), name
    for name in ("c", "c.delay.5s", "c.delay.1h", "c.delay"):
        assert quorum[name]["x-dead-letter-strategy"] == "at-least-once", name
        assert quorum[name]["x-overflow"] == "reject-publish", name
    assert quorum["c"]["x-dead-letter-routing-key"] == "c.dlq"
    assert quorum["c.delay.30s"]["x-dead-letter-routing-key"] == "c"


def test_the_plugin_lists_its_options_for_the_configuration_reference() -> None:
    options = transport_plugin("amqp://h/").url_options()
    assert [(o.name, o.default) for o in options] == [
        ("queue_type", "classic"),
        ("batches_in_flight", "1"),
    ]


def test_batches_in_flight_is_read_from_the_url_and_checked() -> None:
    assert BrokerUrl.parse("amqp://h/").options.batches_in_flight == 1
    parsed = BrokerUrl.parse("amqp://h/?batches_in_flight=3&heartbeat=30")
    assert parsed.options.batches_in_flight == 3
    assert parsed.nodes == ("amqp://h/?heartbeat=30",)
    for bad in ("0", "two"):
        with pytest.raises(ConfigurationError, match="batches_in_flight"):
            BrokerUrl.parse(f"amqp://h/?batches_in_flight={bad}")


class Opener:
    """A stand-in for aiormq.connect: refuses, hangs or answers per host."""

    def __init__(self, behaviour: dict[str, str]) -> None:
        self.behaviour = behaviour
        self.tried: list[str] = []

    async def __call__(self, url: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        self.tried.append(url)
        host = url.split("@")[-1].split("/")[0]
        if self.behaviour.get(host) == "refuse":
            raise ConnectionRefusedError(111, "Connection refused")
        if self.behaviour.get(host) == "hang":
            await asyncio.sleep(60)
        if self.behaviour.get(host) == "reset":  # accepted, then closed during the handshake
            raise asyncio.IncompleteReadError(b"", 7)
        return url, kwargs


async def test_connect_takes_the_first_node_that_answers_in_order() -> None:
    opener = Opener({"a:1": "refuse", "b:2": "hang", "c:3": "reset"})
    url = "amqp://g:secret@a:1,b:2,c:3,d:4/v?queue_type=quorum"
    connection, kwargs = await connect(url, opener, timeout_s=0.8, client_properties={"x": 1})
    assert connection == "amqp://g:secret@d:4/v"
    assert kwargs == {"client_properties": {"x": 1}}
    assert opener.tried == [f"amqp://g:secret@{n}/v" for n in ("a:1", "b:2", "c:3", "d:4")]


async def test_connect_names_every_node_when_none_answers_without_the_password() -> None:
    opener = Opener({"a:1": "refuse", "b:2": "refuse"})
    with pytest.raises(AMQPConnectionError) as caught:
        await connect("amqp://g:secret@a:1,b:2/", opener, timeout_s=1)
    text = str(caught.value)
    assert "a:1" in text and "b:2" in text and "secret" not in text
    # One node: its own error, as before.
    with pytest.raises(ConnectionRefusedError):
        await connect("amqp://g:secret@a:1/", opener, timeout_s=1)
