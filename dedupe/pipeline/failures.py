"""What a handler's failure means: whether it is worth another attempt, and how it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tenacity import wait_exponential_jitter

from dedupe.claims.database import scheduled_wait
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


def retry_delay(handler: Handler, failed: int, exc: BaseException) -> float:
    """The wait before the next attempt: Retry(delay_s=...) as asked, otherwise the handler's
    exponential backoff with jitter after attempt number `failed` (tenacity's schedule). The
    number is the claim's count, so the backoff keeps growing across parked retries."""
    if isinstance(exc, Retry) and exc.delay_s is not None:
        return float(exc.delay_s)
    backoff = wait_exponential_jitter(
        multiplier=handler.backoff_s, max=handler.max_backoff_s, jitter=handler.backoff_s
    )
    return scheduled_wait(backoff, failed)


__all__ = ["describe", "retry_delay", "transient"]
