"""The Kafka entry point (`kafka://`): its transport, publisher and admin client."""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka.errors import KafkaConnectionError

from dedupe.plugins import BrokerAdmin, UrlOption
from dedupe.settings import Settings
from dedupe.transport import Publisher, Transport
from dedupe_kafka.admin import KafkaAdmin
from dedupe_kafka.options import url_options
from dedupe_kafka.publisher import KafkaPublisher
from dedupe_kafka.transport import KafkaTransport


class KafkaPlugin:
    """dedupe.plugins.TransportPlugin for Kafka, registered in pyproject.toml."""

    name = "Kafka"
    unreachable: tuple[type[BaseException], ...] = (OSError, KafkaConnectionError)
    dead_letters_kept = True  # <channel>.dlq is a log: a replay leaves it, moving its offsets

    def transport(self, settings: Settings, *, app_name: str | None = None) -> Transport:
        """The worker's consumer; its group is named after the app unless the URL names one."""
        return KafkaTransport(settings.broker_url, settings=settings, app_name=app_name)

    def publisher(self, settings: Settings) -> Publisher:
        return KafkaPublisher(settings.broker_url)

    def admin(self, url: str) -> BrokerAdmin:
        return KafkaAdmin(url)

    def url_options(self) -> Sequence[UrlOption]:
        return url_options()


plugin = KafkaPlugin()
