"""The Kafka transport (aiokafka): offsets committed only past messages whose outcome is recorded;
the idempotent producer and publisher, dead letters, retry topics, request-reply and the operator
client; registered as `kafka://`."""

from __future__ import annotations

# Every module of the package imports aiokafka; without it, say which extra to install.
try:
    import aiokafka  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the Kafka transport needs aiokafka: pip install 'dedupe-worker[kafka]'"
    ) from exc

from dedupe_kafka.admin import (
    KafkaAdmin,
    backlog,
    delete_channels,
    group_offsets,
    partitions_of,
    peek_dead_letters,
    replay_dead_letters,
    replay_group,
)
from dedupe_kafka.options import KafkaOptions, group_id_for, with_options
from dedupe_kafka.publisher import (
    KafkaPublisher,
    encode_headers,
    ensure_topics,
    idempotent_producer,
    publish,
)
from dedupe_kafka.retries import (
    DUE_AT_HEADER,
    ORIGIN_HEADER,
    retry_bucket,
    retry_topic,
    retry_topics,
)
from dedupe_kafka.transport import KafkaTransport

__all__ = [
    "DUE_AT_HEADER",
    "ORIGIN_HEADER",
    "KafkaAdmin",
    "KafkaOptions",
    "KafkaPublisher",
    "KafkaTransport",
    "backlog",
    "delete_channels",
    "encode_headers",
    "ensure_topics",
    "group_id_for",
    "group_offsets",
    "idempotent_producer",
    "partitions_of",
    "peek_dead_letters",
    "publish",
    "replay_dead_letters",
    "replay_group",
    "retry_bucket",
    "retry_topic",
    "retry_topics",
    "with_options",
]
