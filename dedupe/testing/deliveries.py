"""What the in-memory broker hands over and keeps: deliveries, the messages they carry, and
what became of each (Settled), by published message (Sent)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dedupe.claims.records import Reason
from dedupe.message import Headers, Message
from dedupe.transport import Settlement, dead_letter_headers

Fate = Literal["acked", "dead_lettered", "redelivered", "ack_lost", "dropped"]


@dataclass(eq=False)
class MemoryDelivery:
    """A message plus what the core decided about it, every settlement in order."""

    message: Message
    settlements: list[Settlement] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by the broker: what the settlement means to it (False: it never got it).
    on_settle: Callable[[MemoryDelivery, Settlement], bool] | None = field(default=None, repr=False)
    # Set by a test: the transport took it back (as a revoked Kafka partition does); a claim of
    # it whose handler has not started is given back and requeued (dedupe.transport.Delivery).
    withdrawn: bool = False

    async def settle(self, settlement: Settlement) -> bool:
        self.settlements.append(settlement)
        self.settled.set()
        return True if self.on_settle is None else self.on_settle(self, settlement)

    @property
    def outcome(self) -> Settlement | None:
        return self.settlements[-1] if self.settlements else None


def make_message(
    channel: str,
    body: bytes | str,
    *,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    attempt: int = 1,
    meta: Mapping[str, Any] | None = None,
) -> Message:
    """Build a Message the way a broker would hand it over."""
    return Message(
        channel=channel,
        body=body.encode() if isinstance(body, str) else body,
        headers=Headers(headers or {}),
        message_id=message_id,
        attempt=attempt,
        content_type="application/json",
        meta=meta or {},
    )


def encode_body(body: bytes | str | Any) -> bytes:
    """A message body: bytes as they are, text as UTF-8, anything else as JSON."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    dump = getattr(body, "model_dump_json", None)  # a pydantic model
    if callable(dump):
        return str(dump()).encode()
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Settled:
    """What a consumer told the broker about one delivery, and what the broker made of it.

    `fate`: acked, dead_lettered, redelivered (deferred or requeued: delivered again),
    ack_lost (the broker never got the ack and delivers it again) or dropped (told by a
    consumer whose connection was gone: the broker never got it).
    """

    message: Message
    settlement: Settlement
    consumer: str
    fate: Fate

    @property
    def channel(self) -> str:
        return self.message.channel

    @property
    def reason(self) -> Reason | None:
        return self.settlement.reason

    @property
    def detail(self) -> str | None:
        return self.settlement.detail

    @property
    def duplicate(self) -> bool:
        return self.settlement.duplicate

    @property
    def result(self) -> Any:
        """The stored outcome the settlement carries, decoded (None when there is none)."""
        text = self.settlement.result
        return None if text is None else json.loads(text)

    @property
    def headers(self) -> dict[str, str]:
        """The headers a dead letter carries on the real brokers (x-dedupe-reason, ...)."""
        return dead_letter_headers(self.settlement) if self.fate == "dead_lettered" else {}


class Sent:
    """A published message: what became of each of its copies and redeliveries."""

    def __init__(self, message: Message) -> None:
        self.message = message
        self.log: list[Settled] = []
        self.deliveries = 0

    @property
    def message_id(self) -> str:
        assert self.message.message_id is not None
        return self.message.message_id

    @property
    def outcome(self) -> Settled | None:
        """The last final settlement (acked or dead-lettered) of its copies, if any yet."""
        final = [s for s in self.log if s.fate in ("acked", "dead_lettered")]
        return final[-1] if final else None

    def __repr__(self) -> str:
        fates = ", ".join(s.fate for s in self.log) or "not settled"
        return f"Sent({self.message.channel!r}, id={self.message_id!r}: {fates})"


__all__ = ["Fate", "MemoryDelivery", "Sent", "Settled", "encode_body", "make_message"]
