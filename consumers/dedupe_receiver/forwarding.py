"""The headers a webhook request forwards to the broker: its own, minus credentials and
hop-by-hop ones, plus the webhook's source, key and tenant; and the size of that list, as the
bound on it counts it."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

from dedupe.webhooks import WEBHOOK_KEY_HEADER, Identity, WebhookSource

# Forwarded headers are counted as HTTP/2 counts a header list (name + value + 32 bytes
# each); the bound keeps an AMQP header frame far under RabbitMQ's frame_max (128 KiB).
MAX_FORWARDED_HEADER_BYTES = 32 * 1024

# Headers that are never forwarded to the broker: hop-by-hop ones, credentials and
# signatures (a handler has no use for them and they must not sit in a queue), and the
# ones the transports and this receiver set themselves.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "keep-alive",
        "message-id",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_CREDENTIAL = re.compile(
    r"auth|cookie|signature|secret|token|password|passwd|api[-_]?key|credential|^x-dedupe-", re.I
)
SOURCE_HEADER = "x-dedupe-webhook-source"
TENANT_HEADER = "x-dedupe-webhook-tenant"


def forwarded_headers(
    headers: Mapping[str, str], source: WebhookSource, identity: Identity
) -> dict[str, str]:
    """The request's headers minus credentials and hop-by-hop ones, plus the webhook's own."""
    forward: dict[str, str] = {}
    for name, value in headers.items():
        lower = _forwarded_name(name)
        if lower is not None:
            forward[lower] = value
    forward[SOURCE_HEADER] = source.name
    forward[WEBHOOK_KEY_HEADER] = identity.key
    if identity.tenant is not None:
        forward[TENANT_HEADER] = identity.tenant
    return forward


@functools.lru_cache(maxsize=1024)
def _forwarded_name(name: str) -> str | None:
    """The name a header is forwarded under (lower case), None for one never forwarded;
    remembered, since the same few names come with every request."""
    lower = name.lower()
    if lower in _HOP_BY_HOP or _CREDENTIAL.search(name):
        return None
    return lower


def header_list_bytes(headers: Mapping[str, str]) -> int:
    """The size of a header list as HTTP/2 counts it: UTF-8 name + value + 32 per header."""
    return sum(len(name.encode()) + len(value.encode()) + 32 for name, value in headers.items())


__all__ = [
    "MAX_FORWARDED_HEADER_BYTES",
    "SOURCE_HEADER",
    "TENANT_HEADER",
    "forwarded_headers",
    "header_list_bytes",
]
