"""Transports and servers plug in by entry point: the core finds them by URL scheme and name."""

from __future__ import annotations

import re
from importlib.metadata import entry_points

import pydantic
import pytest

from dedupe.errors import ConfigurationError
from dedupe.plugins import server, transport_plugin
from dedupe.registry import SERVERS, TRANSPORTS
from dedupe.settings import Settings
from dedupe_kafka.transport import KafkaTransport
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_rabbitmq.transport import RabbitMQTransport
from tests.conftest import ROOT

# What the goal greps for, as the before-stop hook does.
FORBIDDEN_IMPORT = re.compile(
    r"^\s*(from|import) (consumers|dedupe_\w+|aio_pika|aiormq|aiokafka|starlette|uvicorn)\b",
    re.MULTILINE,
)


def test_the_core_imports_no_transport_no_broker_client_and_no_http_library() -> None:
    """dedupe/ finds transports and servers by entry point; it never imports them."""
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
        for path in sorted((ROOT / "dedupe").rglob("*.py"))
        for match in FORBIDDEN_IMPORT.finditer(path.read_text())
    ]
    assert found == []


def test_our_transports_are_registered_by_url_scheme() -> None:
    """pyproject.toml registers RabbitMQ as amqp and amqps, Kafka as kafka."""
    registered = {ep.name: ep.value for ep in entry_points(group=TRANSPORTS)}
    assert {"amqp", "amqps", "kafka"} <= set(registered)
    assert transport_plugin("amqp://guest:guest@127.0.0.1:5672/").name == "RabbitMQ"
    assert transport_plugin("AMQPS://broker.example/").name == "RabbitMQ"
    assert transport_plugin("kafka://127.0.0.1:9092").name == "Kafka"


def test_the_receiver_and_the_status_page_are_registered_servers() -> None:
    registered = {ep.name for ep in entry_points(group=SERVERS)}
    assert {"receiver", "status"} <= registered
    assert callable(server("receiver")) and callable(server("status"))


def test_a_url_without_an_installed_transport_says_what_is_installed() -> None:
    with pytest.raises(ConfigurationError, match=r"no transport is installed for 'nats'.*amqp://"):
        transport_plugin("nats://127.0.0.1:4222")
    with pytest.raises(ConfigurationError, match="the billing server is not installed"):
        server("billing")


def test_a_broker_url_is_refused_at_the_edge_unless_a_transport_takes_its_scheme() -> None:
    """Settings accept any installed scheme (a third party's too) and name the installed ones."""
    assert Settings(broker_url="amqps://broker.example/").broker_url == "amqps://broker.example/"
    with pytest.raises(pydantic.ValidationError, match=r"no transport is installed for nats://"):
        Settings(broker_url="nats://127.0.0.1:4222")
    with pytest.raises(pydantic.ValidationError, match=r"expected a broker URL"):
        Settings(broker_url="127.0.0.1:5672")


def test_the_rabbitmq_plugin_builds_a_worker_transport_from_the_settings() -> None:
    settings = Settings(broker_url="amqp://h/", concurrency=5, worker_name="w-1")
    plugin = transport_plugin(settings.broker_url)
    transport = plugin.transport(settings, app_name="shop")
    assert isinstance(transport, RabbitMQTransport)
    assert (transport.prefetch, transport.batch_max) == (40, 40)  # 8 x concurrency
    assert transport.connection_name == "dedupe-worker w-1"
    assert isinstance(plugin.publisher(settings), RabbitMQPublisher)
    assert plugin.dead_letters_kept is False
    assert ConnectionError in plugin.unreachable or OSError in plugin.unreachable


def test_the_kafka_plugin_names_the_group_after_the_app_and_keeps_dead_letters() -> None:
    settings = Settings(broker_url="kafka://h:9092", worker_name="w-1")
    plugin = transport_plugin(settings.broker_url)
    transport = plugin.transport(settings, app_name="shop")
    assert isinstance(transport, KafkaTransport)
    assert transport.options.group_id == "dedupe-shop"
    assert plugin.dead_letters_kept is True
    names = [option.name for option in plugin.url_options()]
    assert "group_id" in names and "bootstrap_servers" not in names
