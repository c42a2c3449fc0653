"""The RabbitMQ transport: consume channels (on aiormq) and settle deliveries as the core
decides, publish with confirms and the operator client (on aio-pika); registered as `amqp://`
and `amqps://`."""

from __future__ import annotations

# Every module of the package imports aio-pika or aiormq (which aio-pika brings); without
# them, say which extra to install.
try:
    import aio_pika  # noqa: F401
    import aiormq  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the RabbitMQ transport needs aio-pika: pip install 'dedupe-worker[rabbitmq]'"
    ) from exc

from dedupe_rabbitmq.admin import (
    RabbitMQAdmin,
    delete_channels,
    peek_dead_letters,
    publish,
    replay_dead_letters,
)
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_rabbitmq.topology import declare_channel, delay_name, delay_queues
from dedupe_rabbitmq.transport import RabbitMQTransport

__all__ = [
    "RabbitMQAdmin",
    "RabbitMQPublisher",
    "RabbitMQTransport",
    "declare_channel",
    "delay_name",
    "delay_queues",
    "delete_channels",
    "peek_dead_letters",
    "publish",
    "replay_dead_letters",
]
