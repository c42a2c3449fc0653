"""Which transports and servers are installed: the entry points registered under the groups
`dedupe.transports` (by URL scheme) and `dedupe.servers` (dedupe.plugins loads them)."""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoint, entry_points

TRANSPORTS = "dedupe.transports"
SERVERS = "dedupe.servers"


def scheme_of(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else ""


@cache
def registered(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def installed_schemes() -> list[str]:
    """The URL schemes an installed transport takes, e.g. ["amqp", "amqps", "kafka"]."""
    return sorted(registered(TRANSPORTS))


__all__ = ["SERVERS", "TRANSPORTS", "installed_schemes", "registered", "scheme_of"]
