"""Kafka request-reply: a record naming a reply topic gets its stored outcome written there.

A request carries `reply-to: <topic>` and, usually, `correlation-id: <anything>`. Once its
outcome is recorded (a run's, or the stored one for a duplicate), the result goes to that topic
as JSON with the correlation id (as header and record key) before the request's offset counts
as done. The reply topic is the caller's: the worker never creates it (a broker that creates
topics on first use will).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
)
from aiokafka.structs import ConsumerRecord

from dedupe.message import Headers
from dedupe.transport import Settlement, reply_of

logger = logging.getLogger(__name__)

REPLY_TO_HEADER = "reply-to"
CORRELATION_ID_HEADER = "correlation-id"
# One try at a reply: a broker that does not answer in this time holds the request (it is
# tried again later) instead of stalling its partition's batch.
REPLY_TIMEOUT_S = 10.0
# Kafka's own rule for topic names; a reply-to outside it can never be answered.
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
# Refusals no later try can change: the reply is dropped, the outcome stays recorded.
_NEVER = (InvalidTopicError, MessageSizeTooLargeError, RecordTooLargeError)


class Replies:
    """Writes replies with the transport's idempotent producer (None while it is closed)."""

    def __init__(
        self,
        producer: Callable[[], AIOKafkaProducer | None],
        *,
        timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self._producer = producer
        self.timeout_s = timeout_s

    async def send(
        self,
        record: ConsumerRecord,
        settlement: Settlement,
        closing: Callable[[], bool],
    ) -> bool:
        """Answer the record for its settlement (dedupe.transport.reply_of: the stored result
        or a fault reply); True when done (or when it asks for no reply, or there is nothing
        to tell).

        False (the partition holds the request and tries again later) when the broker did not
        take the reply; a reply that can never be written is logged and counts as done, as on
        RabbitMQ: the outcome is recorded, and a caller that retries gets a duplicate's reply.
        """
        if not any(k.lower() == REPLY_TO_HEADER for k, _ in record.headers or ()):
            return True  # no reply asked for (the case of most records: skip the headers)
        headers = Headers(dict(record.headers or ()))
        topic = headers.get(REPLY_TO_HEADER)
        reply = reply_of(settlement)
        if not topic or reply is None:
            return True
        where = f"{record.topic}/{record.partition}/{record.offset}"
        if not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
            logger.warning(
                "cannot reply to %s: its reply-to is not a Kafka topic name; the outcome stays "
                "recorded",
                where,
            )
            return True
        correlation = next(
            (
                bytes(v)
                for k, v in record.headers or ()
                if k.lower() == CORRELATION_ID_HEADER and v is not None  # a null header: none
            ),
            None,
        )
        reply_headers = [("content-type", b"application/json")]
        body, ours = reply
        reply_headers += [(name, value.encode()) for name, value in ours.items()]
        if correlation is not None:
            reply_headers.insert(0, (CORRELATION_ID_HEADER, correlation))
        producer = self._producer()
        if producer is None:
            return False  # the transport is closing: the next owner answers it
        try:
            async with asyncio.timeout(self.timeout_s):
                await producer.send_and_wait(
                    topic,
                    value=body,
                    key=correlation,
                    headers=reply_headers,
                )
        except _NEVER as exc:
            logger.error(
                "cannot reply to %s on %s (%s); the outcome stays recorded", where, topic, exc
            )
            return True
        except (KafkaError, TimeoutError) as exc:
            if not closing():
                logger.warning(
                    "the reply to %s on %s was not written (%s): the request is held and "
                    "answered again later; its partition commits no further meanwhile",
                    where,
                    topic,
                    exc.__class__.__name__ if isinstance(exc, TimeoutError) else exc,
                )
            return False
        return True


__all__ = ["CORRELATION_ID_HEADER", "REPLY_TO_HEADER", "Replies"]
