"""Kafka dead letters: a record copied to <channel>.dlq with the reason (body-less if it must be).

A dead letter the broker can never take whole (too large once our headers are added) goes out
without its body, with a header saying why. A copy from a retry topic (dedupe_kafka.retries)
dead-letters to its channel's `.dlq`, with the original record as its origin.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
)
from aiokafka.structs import ConsumerRecord

from dedupe.claims.keys import MESSAGE_ID_HEADER
from dedupe.transport import (
    BODY_DROPPED_HEADER,
    DEAD_LETTER_HEADERS,
    Settlement,
    dead_letter_headers,
    dlq_name,
)
from dedupe_kafka.publisher import encode_headers
from dedupe_kafka.retries import ORIGIN_HEADER, RETRY_HEADERS, origin_of

logger = logging.getLogger(__name__)


class DeadLetters:
    """Writes dead letters with the transport's idempotent producer (None while it is closed)."""

    def __init__(
        self, producer: Callable[[], AIOKafkaProducer | None], stopping: Callable[[], bool]
    ) -> None:
        self._producer = producer
        self._stopping = stopping

    async def send(
        self, record: ConsumerRecord, settlement: Settlement, closing: Callable[[], bool]
    ) -> bool:
        """Write the record to <channel>.dlq with the reason; True once the broker has it.

        A copy too large for the broker (a record near the size limit plus our headers) goes
        out without its body, with a header saying why; any other refusal, or a failure of
        that too, gives False: the partition holds the message, tries again later and never
        commits past it.
        """
        # Ours from an earlier trip (a replay, a retry topic) go; the origin is the original's.
        ours = {*DEAD_LETTER_HEADERS, *RETRY_HEADERS, BODY_DROPPED_HEADER}
        headers = [(k, v) for k, v in record.headers or () if k not in ours]
        headers += encode_headers(dead_letter_headers(settlement))
        channel, partition, offset = origin_of(record)
        headers.append((ORIGIN_HEADER, f"{channel}/{partition}/{offset}".encode()))
        topic = dlq_name(channel)
        fields = _fields(record, settlement)
        where = f"{record.topic}/{record.partition}/{record.offset}"
        try:
            if not await self._write(topic, record.key, record.value, headers, closing):
                return False
        except KafkaError as exc:
            if not isinstance(exc, MessageSizeTooLargeError | RecordTooLargeError):
                # Refused for another reason (a policy, a bad record): keep the body and let
                # the partition hold the message and try again; an operator can see why.
                logger.error(
                    "the dead letter of %s was refused (%s): the message is held and tried "
                    "again later; its partition commits no further",
                    where,
                    exc,
                    extra=fields,
                )
                return False
            size = len(record.value or b"")
            logger.error(
                "the dead letter of %s cannot be written (%s); writing it without its %d-byte body",
                where,
                exc,
                size,
                extra=fields,
            )
            dropped = [*headers, (BODY_DROPPED_HEADER, f"{size} bytes: {exc}"[:500].encode())]
            try:
                if not await self._write(topic, record.key, b"", dropped, closing):
                    return False
            except KafkaError as again:
                logger.error(
                    "the dead letter of %s cannot be written even without its body (%s): the "
                    "message is held and tried again later; its partition commits no further",
                    where,
                    again,
                    extra=fields,
                )
                return False
        logger.warning(
            "dead-lettered %s to %s: %s (%s)",
            where,
            topic,
            settlement.reason,
            settlement.detail,
            extra=fields,
        )
        return True

    async def _write(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        closing: Callable[[], bool],
    ) -> bool:
        """Send one record, retrying transient errors; False when stopping or revoked first.

        Raises KafkaError when the broker can never take the record.
        """
        delay = 0.2
        while True:
            producer = self._producer()
            try:
                if producer is None:
                    raise KafkaError("the transport is closed")
                await producer.send_and_wait(topic, value=value, key=key, headers=headers)
                return True
            except KafkaError as exc:
                if self._stopping() or producer is None or closing():
                    logger.warning(
                        "could not write to %s (%s); left uncommitted for the next owner",
                        topic,
                        exc,
                    )
                    return False
                if not _transient(exc):
                    raise
                logger.warning("dead-letter write failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


def _transient(exc: KafkaError) -> bool:
    # A timeout says nothing about the record: worth another try, like the retriable errors.
    return bool(exc.retriable) or isinstance(exc, KafkaTimeoutError)


def _fields(record: ConsumerRecord, settlement: Settlement) -> dict[str, Any]:
    """The log fields of a dead letter (see dedupe.observability.logs.FIELDS)."""
    message_id = dict(record.headers or ()).get(MESSAGE_ID_HEADER)
    return {
        "channel": origin_of(record)[0],
        "scope": settlement.scope,
        "key": settlement.key,
        "message_id": message_id.decode("utf-8", "replace") if message_id else None,
        "reason": str(settlement.reason),
        "outcome": str(settlement.action),
    }
