"""The broker-agnostic envelope handed from a transport to the core."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

_T = TypeVar("_T")


class Headers(Mapping[str, str]):
    """Read-only headers looked up case-insensitively (HTTP and AMQP disagree on case)."""

    __slots__ = ("_items", "_lower")

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        self._items: dict[str, str] = {}
        for name, value in (items or {}).items():
            if value is None:
                continue
            if isinstance(value, bytes | bytearray):
                value = bytes(value).decode("utf-8", "replace")
            self._items[str(name)] = str(value)
        self._lower = {name.lower(): value for name, value in self._items.items()}

    def __getitem__(self, name: str) -> str:
        return self._lower[name.lower()]

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str | _T) -> str | _T: ...
    def get(self, name: str, default: object = None) -> object:
        # Mapping.get goes through __getitem__ and a KeyError for every header not there.
        return self._lower.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._lower

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Headers({sorted(self._items)!r})"


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery: raw body, headers, the broker's message id and where it came from.

    `attempt` is the delivery attempt as far as the broker knows it (1 on first delivery);
    the claim's own attempt counter, which survives crash loops, is `Context.attempt`.
    """

    channel: str
    body: bytes
    headers: Headers = field(default_factory=Headers)
    message_id: str | None = None
    attempt: int = 1
    content_type: str | None = None
    # Transport coordinates, e.g. {"topic": ..., "partition": ..., "offset": ...} on Kafka.
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def payload_hash(self) -> bytes:
        """SHA-256 of the body: two messages under one key must carry the same payload."""
        return hashlib.sha256(self.body).digest()
