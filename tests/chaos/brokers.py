"""The chaos suite's view of a broker: the integration tests' one, plus the URL that worker
processes get and a dead-letter read without the integration tests' small limit."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Sequence
from typing import Any

import aio_pika
import aiormq
from aiokafka.admin import AIOKafkaAdminClient

import dedupe_kafka as kafka
import dedupe_rabbitmq as rabbitmq
from tests.integration.brokers import KafkaBroker, RabbitBroker


class ChaosRabbit(RabbitBroker):
    """`nodes`: the Erlang node names rabbitmqctl asks (`-n`), the first that answers; none:
    the local default node (scripts/services.sh's)."""

    def __init__(self, url: str, nodes: Sequence[str] = ()) -> None:
        super().__init__(url)
        self.nodes = tuple(nodes)

    def worker_url(self, channel: str) -> str:
        return self.url

    async def backlog(self, channel: str) -> int:
        """Messages of the channel and its delay queue, ready *or delivered but not yet
        acknowledged* (AMQP's queue.declare counts only the ready ones, so a message a worker
        keeps failing to settle would look drained)."""
        names = {channel, *rabbitmq.delay_queues(channel)}
        for node in self.nodes or (None,):
            at = ["-n", node] if node else []
            listing = await asyncio.to_thread(
                subprocess.run,
                ["rabbitmqctl", "-q", *at, "list_queues", "name", "messages"],
                capture_output=True,
                text=True,
                timeout=60,
                cwd="/",
            )
            if listing.returncode == 0:  # a node of a cluster may be down: the next one
                break
        else:
            return await super().backlog(channel)
        total = 0
        for line in listing.stdout.splitlines():
            parts = line.split("\t")
            if len(parts) == 2 and parts[0] in names and parts[1].isdigit():
                total += int(parts[1])
        return total

    async def dead_letters(self, channel: str, limit: int = 100) -> list[dict[str, Any]]:
        return await rabbitmq.peek_dead_letters(self.url, channel, limit=limit)

    async def consumers(self, channel: str) -> int:
        """Consumers attached to the channel's queue (0 before a worker declared it)."""
        connection = await aio_pika.connect(self.url, timeout=10)
        async with connection:
            amqp = await connection.channel()
            try:
                queue = await amqp.declare_queue(channel, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return 0
            return int(queue.declaration_result.consumer_count or 0)


class ChaosKafka(KafkaBroker):
    def worker_url(self, channel: str) -> str:
        return self.url  # carries the scenario's own consumer group

    async def dead_letters(self, channel: str, limit: int = 100) -> list[dict[str, Any]]:
        return await kafka.peek_dead_letters(self.url, channel, limit=limit)

    async def consumers(self, channel: str) -> int:
        """Members of the scenario's group once it is stable (0 while it rebalances)."""
        servers = kafka.KafkaOptions.from_url(self.url).bootstrap_servers
        admin = AIOKafkaAdminClient(bootstrap_servers=servers, request_timeout_ms=15_000)
        await admin.start()
        try:
            [response] = await admin.describe_consumer_groups([self.group_id])
        finally:
            await admin.close()
        [group] = response.to_object()["groups"]
        return len(group["members"]) if group["state"] == "Stable" else 0
