"""The Kafka clients besides the consumer, by their old import path (consumers.kafka_clients).

They live in kafka_options (the URL's options), kafka_publisher (topics, the idempotent
producer, the publisher) and kafka_admin (dead letters, backlog, deleting topics).
"""

from __future__ import annotations

from dedupe.transport import BODY_DROPPED_HEADER

from .kafka_admin import (
    KafkaAdmin,
    backlog,
    delete_channels,
    group_offsets,
    partitions_of,
    peek_dead_letters,
    replay_dead_letters,
    replay_group,
)
from .kafka_dead_letters import ORIGIN_HEADER
from .kafka_options import KafkaOptions, group_id_for, with_options
from .kafka_publisher import (
    KafkaPublisher,
    encode_headers,
    ensure_topics,
    idempotent_producer,
    publish,
)

__all__ = [
    "BODY_DROPPED_HEADER",
    "ORIGIN_HEADER",
    "KafkaAdmin",
    "KafkaOptions",
    "KafkaPublisher",
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
    "with_options",
]
