"""Kafka options come from the broker URL; the consumer group is named after the app."""

from __future__ import annotations

import pytest

from dedupe.errors import ConfigurationError
from dedupe.settings import Settings
from dedupe_kafka.options import KafkaOptions, with_options
from dedupe_kafka.transport import KafkaTransport


def test_the_group_is_named_after_the_app_unless_the_url_names_one() -> None:
    assert KafkaTransport("kafka://127.0.0.1:9092", app_name="shop").options.group_id == (
        "dedupe-shop"
    )
    named = KafkaTransport("kafka://127.0.0.1:9092?group_id=billing", app_name="shop")
    assert named.options.group_id == "billing"


def test_url_options_are_typed_and_win_over_settings() -> None:
    settings = Settings(broker_url="kafka://a:9092", concurrency=8, worker_name="w1")
    transport = KafkaTransport(
        "kafka://a:9092,b:9092?partitions=8&commit_interval_s=0.5&batch_max=10", settings=settings
    )
    options = transport.options
    assert options.bootstrap_servers == "a:9092,b:9092"
    assert (options.partitions, options.commit_interval_s, options.batch_max) == (8, 0.5, 10)
    assert options.client_id == "w1"
    assert KafkaTransport("kafka://a:9092", settings=settings).options.batch_max == 64  # 8 x 8


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("kafka://a:9092?colour=red", "unknown Kafka option 'colour'"),
        ("kafka://a:9092?partitions=many", "partitions='many'"),
        ("kafka://a:9092?partitions=0", "partitions must be at least 1"),
        ("kafka://a:9092?group_id=", "group_id must not be empty"),
        ("amqp://a:5672/", "expected kafka://"),
    ],
)
def test_bad_options_say_what_is_wrong(url: str, complaint: str) -> None:
    with pytest.raises(ConfigurationError, match=complaint.replace("(", r"\(")):
        KafkaOptions.from_url(url)


def test_with_options_adds_query_parameters() -> None:
    url = with_options("kafka://a:9092", group_id="g 1")
    assert url == "kafka://a:9092?group_id=g+1"
    assert KafkaOptions.from_url(with_options(url, partitions=2)).group_id == "g 1"


def test_a_request_size_below_one_byte_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="max_request_size must be at least 1"):
        KafkaOptions.from_url("kafka://127.0.0.1:9092?max_request_size=0").check()


def test_batches_in_flight_is_bounded_by_what_a_partition_may_hold() -> None:
    def depth(query: str) -> int:
        return KafkaOptions.from_url(f"kafka://localhost:9092?{query}").depth

    assert depth("batch_max=64") == 4  # batches_in_flight's default
    assert depth("") == 3  # batch_max 256: three fit in max_held 1000
    assert depth("batch_max=64&batches_in_flight=8") == 8
    assert depth("batch_max=500&max_held=1000&batches_in_flight=8") == 2
    assert depth("batch_max=64&max_held=10") == 1  # one batch at least
    with pytest.raises(ConfigurationError, match="batches_in_flight"):
        KafkaOptions.from_url("kafka://localhost:9092?batches_in_flight=0")
