"""What a handler's failure means: whether it is worth another attempt, and how it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dedupe.claims.values import storable_error
from dedupe.errors import DedupeError, Retry

if TYPE_CHECKING:
    from dedupe.app import Handler


def describe(exc: BaseException | None) -> str:
    """An error as one storable line: its class and (the start of) its message."""
    if exc is None:
        return "unknown error"
    if isinstance(exc, TimeoutError):
        return "TimeoutError: handler timed out"
    return storable_error(exc)


def transient(handler: Handler, exc: BaseException) -> bool:
    """Whether the handler's error is worth another attempt."""
    if isinstance(exc, Retry):
        return True
    return isinstance(exc, handler.retry_on) and not isinstance(exc, DedupeError)


__all__ = ["describe", "transient"]
