"""Every RabbitMQ connection of the package is opened here: the URL's nodes tried in order.

The transport (aiormq), the publisher of the outbox relay and the receiver (aio-pika) and the
operators' functions (aio-pika) all call `connect`, on their first connect and on every
reconnect, so a worker whose node went away finds another node of the cluster by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiormq.exceptions import AMQPConnectionError

from dedupe.claims.database import redact
from dedupe_rabbitmq.options import BrokerUrl

logger = logging.getLogger(__name__)

C = TypeVar("C")


async def connect(
    url: str, opener: Callable[..., Awaitable[C]], *, timeout_s: float, **kwargs: Any
) -> C:
    """Open a connection to the first node of `url` that takes one, trying them in order.

    `opener` is `aiormq.connect` or `aio_pika.connect`, called with one node's URL and
    `kwargs`. Each node gets `timeout_s` divided among the nodes, so a node that swallows
    packets does not use up the time of the ones after it. When none takes the connection,
    the error (an AMQPConnectionError, which callers already treat as "unreachable") names
    each node and why.
    """
    nodes = BrokerUrl.parse(url).nodes
    each = timeout_s / len(nodes)
    failures: list[str] = []
    last: BaseException | None = None
    for node in nodes:
        try:
            async with asyncio.timeout(each):
                connection = await opener(node, **kwargs)
        except Exception as exc:  # refused, reset, timed out, a broken handshake: the next
            # (an error in our own arguments fails on every node and is raised at the end)
            last = exc
            failures.append(f"{redact(node)} ({str(exc) or type(exc).__name__})")
            logger.debug("could not connect to RabbitMQ at %s: %s", redact(node), exc)
            continue
        if failures:  # a node of the list is down: say so once, with the one that answered
            logger.warning(
                "connected to RabbitMQ at %s; not at %s", redact(node), "; ".join(failures)
            )
        return connection
    if len(nodes) == 1:
        assert last is not None
        raise last
    raise AMQPConnectionError(
        "no RabbitMQ node took the connection: " + "; ".join(failures)
    ) from last


__all__ = ["connect"]
