"""The Kafka side of `make demo BROKER=kafka` (scripts/demo.py drives it).

The workers run with the default consumer group of the payments app (`dedupe-shop`); a reset
deletes the records left in the topics by an earlier run, so a fresh database never sees them
(the group then resumes from the new start of the log).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from aiokafka.structs import TopicPartition

import dedupe_kafka as kafka
from dedupe.transport import dlq_name
from handlers.payments import app


class Kafka:
    """The demo's channels on Kafka: reset, publish, dead letters, backlog. The burst goes to
    `channel`; `receipts` is fed by the workers' outbox relay."""

    name = "Kafka"

    def __init__(self, url: str, channel: str, receipts: str) -> None:
        self.url = url
        self.channel = channel
        self.channels = (channel, receipts)
        self.options = kafka.KafkaOptions.from_url(url)
        self.group_id = kafka.group_id_for(app.name)

    async def reset(self) -> None:
        """Create the topics if needed and delete every record an earlier run left in them."""
        topics = [topic for channel in self.channels for topic in (channel, dlq_name(channel))]
        await kafka.ensure_topics(self.options, topics)
        admin = AIOKafkaAdminClient(bootstrap_servers=self.options.bootstrap_servers)
        await admin.start()
        try:
            described = await admin.describe_topics(topics)
            tps = [
                TopicPartition(topic["topic"], p["partition"])
                for topic in described
                for p in topic["partitions"]
            ]
            ends = await _end_offsets(self.options, tps)
            await admin.delete_records(
                {tp: RecordsToDelete(before_offset=end) for tp, end in ends.items() if end}
            )
        finally:
            await admin.close()

    async def publish(self, messages: list[tuple[bytes, dict[str, Any], str | None]]) -> None:
        """Publish once the workers share the partitions, so that the crash hits a busy one."""
        await self._wait_for_group(members=2)
        await kafka.publish(self.url, self.channel, messages)

    async def _wait_for_group(self, *, members: int, timeout_s: float = 30.0) -> None:
        # A worker joins its group about a second after it starts; RabbitMQ consumers attach
        # at once. Without this wait the first worker would take the whole burst alone.
        admin = AIOKafkaAdminClient(bootstrap_servers=self.options.bootstrap_servers)
        await admin.start()
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                [response] = await admin.describe_consumer_groups([self.group_id])
                [group] = response.to_object()["groups"]
                if group["state"] == "Stable" and len(group["members"]) >= members:
                    return
                await asyncio.sleep(0.1)
            print(f"demo: the group {self.group_id} did not settle in {timeout_s:g}s", flush=True)
        finally:
            await admin.close()

    async def dead_letters(self) -> Counter[str]:
        letters = await kafka.peek_dead_letters(self.url, self.channel, limit=1000)
        return Counter(str(letter["reason"]) for letter in letters)

    async def backlog(self) -> int:
        """Records of both channels and their retry topics the workers' group has not committed
        past yet."""
        lags = [
            await kafka.backlog(self.url, c, self.group_id, with_retry_topics=True)
            for c in self.channels
        ]
        return sum(lags)


async def _end_offsets(
    options: kafka.KafkaOptions, tps: list[TopicPartition]
) -> dict[TopicPartition, int]:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(bootstrap_servers=options.bootstrap_servers)
    await consumer.start()
    try:
        ends: dict[TopicPartition, int] = await consumer.end_offsets(tps)
        return ends
    finally:
        await consumer.stop()
