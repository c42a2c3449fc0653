"""The RabbitMQ transport (aio-pika): consume channels, settle deliveries as the core decides,
publish
with confirms, and the operator client; registered as `amqp://` and `amqps://`."""

from __future__ import annotations

from dedupe_rabbitmq.admin import RabbitMQAdmin
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_rabbitmq.transport import RabbitMQTransport

__all__ = ["RabbitMQAdmin", "RabbitMQPublisher", "RabbitMQTransport"]
