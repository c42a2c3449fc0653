"""Kafka replies (consumers/dedupe_kafka/replies.py) with a fake producer: headers as Kafka gives
them."""

from __future__ import annotations

from typing import Any

from dedupe.transport import Action, Settlement
from dedupe_kafka.replies import Replies
from tests.unit.test_kafka_partition import Record


class Producer:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_and_wait(self, topic: str, **kwargs: Any) -> None:
        self.sent.append({"topic": topic, **kwargs})


async def test_a_null_correlation_id_header_is_no_correlation_id() -> None:
    """Kafka allows a header without a value: the reply goes out without a correlation id
    (before, bytes(None) raised and the request was held and retried for good)."""
    producer = Producer()
    replies = Replies(lambda: producer)  # type: ignore[arg-type,return-value]
    record = Record(0, headers=(("reply-to", b"answers"), ("correlation-id", None)))  # type: ignore[arg-type]
    assert await replies.send(record, Settlement(Action.ACK, result='{"ok": true}'), lambda: False)
    (sent,) = producer.sent
    assert sent["topic"] == "answers" and sent["key"] is None
    assert sent["headers"] == [("content-type", b"application/json")]


async def test_a_record_asking_no_reply_sends_nothing() -> None:
    producer = Producer()
    replies = Replies(lambda: producer)  # type: ignore[arg-type,return-value]
    done = Settlement(Action.ACK, result="{}")
    assert await replies.send(Record(0, headers=(("message-id", b"m"),)), done, lambda: False)
    assert await replies.send(Record(1), done, lambda: False)
    assert producer.sent == []
