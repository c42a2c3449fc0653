"""The chaos suite's view of a broker: the integration tests' one, plus the URL that worker
processes get and a dead-letter read without the integration tests' small limit."""

from __future__ import annotations

from typing import Any

from consumers import kafka, rabbitmq
from tests.integration.brokers import KafkaBroker, RabbitBroker


class ChaosRabbit(RabbitBroker):
    def worker_url(self, channel: str) -> str:
        return self.url

    async def dead_letters(self, channel: str, limit: int = 100) -> list[dict[str, Any]]:
        return await rabbitmq.peek_dead_letters(self.url, channel, limit=limit)


class ChaosKafka(KafkaBroker):
    def worker_url(self, channel: str) -> str:
        return self.url  # carries the scenario's own consumer group

    async def dead_letters(self, channel: str, limit: int = 100) -> list[dict[str, Any]]:
        return await kafka.peek_dead_letters(self.url, channel, limit=limit)
