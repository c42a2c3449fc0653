"""The RabbitMQ entry point (`amqp://`, `amqps://`): its transport, publisher and admin client."""

from __future__ import annotations

from collections.abc import Sequence

from aiormq.exceptions import AMQPConnectionError

from dedupe.plugins import BrokerAdmin, UrlOption
from dedupe.settings import Settings
from dedupe.transport import Publisher, Transport
from dedupe_rabbitmq.admin import RabbitMQAdmin
from dedupe_rabbitmq.options import url_options
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_rabbitmq.transport import RabbitMQTransport


class RabbitMQPlugin:
    """dedupe.plugins.TransportPlugin for RabbitMQ, registered in pyproject.toml."""

    name = "RabbitMQ"
    unreachable: tuple[type[BaseException], ...] = (OSError, AMQPConnectionError)
    dead_letters_kept = False  # <channel>.dlq is a queue: a replay moves its messages out

    def transport(self, settings: Settings, *, app_name: str | None = None) -> Transport:
        return RabbitMQTransport(
            settings.broker_url,
            prefetch=settings.effective_prefetch,
            batch_max=settings.effective_prefetch,
            connection_name=f"dedupe-worker {settings.worker_name}",
        )

    def publisher(self, settings: Settings) -> Publisher:
        return RabbitMQPublisher(settings.broker_url)

    def admin(self, url: str) -> BrokerAdmin:
        return RabbitMQAdmin(url)

    def url_options(self) -> Sequence[UrlOption]:
        # The rest of an AMQP URL's query (heartbeat=, ...) is the client's (aiormq, aio-pika).
        return url_options()


plugin = RabbitMQPlugin()
