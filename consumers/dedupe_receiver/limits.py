"""How much of a webhook request goes on to the broker: the body, read up to a limit that fits
the broker's own limit on a whole message next to the forwarded headers
(dedupe_receiver.forwarding)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, Iterable

from starlette.requests import ClientDisconnect, Request

from dedupe.errors import ConfigurationError
from dedupe.webhooks import MAX_MESSAGE_ID_BYTES, WebhookSource
from dedupe_receiver.forwarding import MAX_FORWARDED_HEADER_BYTES

logger = logging.getLogger(__name__)

# What a message needs besides its body where the broker limits a message's size (Kafka's
# max_request_size): the forwarded headers, the message id as record key and as header,
# and the record batch's own fields.
MESSAGE_OVERHEAD_BYTES = MAX_FORWARDED_HEADER_BYTES + 2 * (MAX_MESSAGE_ID_BYTES + 32) + 512
# A broker limit that leaves less than this for a body is a configuration mistake.
MIN_BODY_LIMIT_BYTES = 64 * 1024
# A refused body is still read to its end, and dropped, if it ends within this many bytes past
# the limit and this many seconds: a client sends the whole body before it reads the answer,
# and a server that closes with bytes unread resets the connection, which destroys the 413
# the client has not read yet (it would retry forever). Past either bound the 413 goes out
# with Connection: close and the client may see the reset.
DISCARD_BYTES = 16 * 1024 * 1024
DISCARD_S = 10.0
# Decimal digits only (str.isdigit() also takes "²"), and few enough for a 64-bit size.
_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")
# The broker refuses the message itself (aiokafka, client- or broker-side): the same request
# fails every time, so it is the client's 413, not a 503 to retry.
_TOO_LARGE_FOR_BROKER = frozenset({"MessageSizeTooLargeError", "RecordTooLargeError"})


def message_limit(publisher: object) -> int | None:
    """The largest message (body, key and headers) `publisher` can send; None: no known limit.

    A publisher says so with a `max_message_bytes` attribute (KafkaPublisher: its
    `max_request_size`, from the broker URL).
    """
    limit = getattr(publisher, "max_message_bytes", None)
    if isinstance(limit, int) and not isinstance(limit, bool):
        return limit
    return None


def fitted_message_limit(sources: Iterable[WebhookSource], publisher: object) -> int | None:
    """The publisher's message limit, checked to leave room for a body (else ConfigurationError);
    each source whose max_body_bytes it cuts is logged. None: the publisher has no limit."""
    limit = message_limit(publisher)
    if limit is None:
        return None
    room = limit - MESSAGE_OVERHEAD_BYTES
    if room < MIN_BODY_LIMIT_BYTES:
        raise ConfigurationError(
            f"the publisher takes messages of at most {limit} bytes, which leaves {room} "
            f"bytes for a body next to up to {MESSAGE_OVERHEAD_BYTES} bytes of headers and "
            f"key; raise the broker's message size limit (Kafka: ?max_request_size= in the "
            "broker URL, with the topics' max.message.bytes)"
        )
    for source in sources:
        if source.max_body_bytes > room:
            logger.info(
                "webhook source %r: bodies over %d bytes are refused with 413 "
                "(max_body_bytes=%d, but the broker takes messages of at most %d bytes, "
                "headers and key included)",
                source.name,
                room,
                source.max_body_bytes,
                limit,
                extra={"source": source.name, "channel": source.channel},
            )
    return limit


def body_limit(source: WebhookSource, limit: int | None) -> int:
    """The largest body taken for `source`: its max_body_bytes, or less when the broker's
    message limit leaves less room (a 413 then, rather than a 503 on every retry)."""
    if limit is None:
        return source.max_body_bytes
    return min(source.max_body_bytes, limit - MESSAGE_OVERHEAD_BYTES)


def too_large_for_broker(exc: BaseException) -> bool:
    cause: BaseException | None = exc
    for _ in range(8):  # the publisher's wrapper, the driver's error and its cause
        if cause is None:
            return False
        if any(cls.__name__ in _TOO_LARGE_FOR_BROKER for cls in type(cause).__mro__):
            return True
        cause = cause.__cause__
    return False


class BodyTooLarge(Exception):
    """Over the limit; `drained`: the rest was read, so the connection can carry another."""

    def __init__(self, *, drained: bool) -> None:
        super().__init__()
        self.drained = drained


class BadContentLength(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; over `limit` bytes it is refused, and what is left is read and dropped
    (within DISCARD_BYTES and DISCARD_S), never kept."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not _CONTENT_LENGTH.fullmatch(declared):
            raise BadContentLength
        if int(declared) > limit:
            # A client waiting for "100 Continue" sends no body unless we read (the server
            # answers 100 at the first read); one declared past the bound is not waited for.
            waiting = "100-continue" in request.headers.get("expect", "").lower()
            if waiting or int(declared) > limit + DISCARD_BYTES:
                raise BodyTooLarge(drained=False)
            raise BodyTooLarge(drained=await _discard(request.stream(), limit + DISCARD_BYTES))
    chunks: list[bytes] = []
    size = 0
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(drained=await _discard(stream, limit + DISCARD_BYTES - size))
            chunks.append(chunk)
    return b"".join(chunks)


async def _discard(stream: AsyncGenerator[bytes, None], budget: int) -> bool:
    """Read and drop the rest of `stream`: True once it ended, False past `budget` bytes or
    DISCARD_S seconds, or when the client went away."""
    async with contextlib.aclosing(stream):
        try:
            async with asyncio.timeout(DISCARD_S):
                async for chunk in stream:
                    budget -= len(chunk)
                    if budget < 0:
                        return False
        except (TimeoutError, ClientDisconnect):
            return False
    return True


__all__ = [
    "DISCARD_BYTES",
    "DISCARD_S",
    "MESSAGE_OVERHEAD_BYTES",
    "MIN_BODY_LIMIT_BYTES",
    "BadContentLength",
    "BodyTooLarge",
    "body_limit",
    "fitted_message_limit",
    "message_limit",
    "read_body",
    "too_large_for_broker",
]
