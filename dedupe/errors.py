"""The one exception root and the control-flow signals handlers may raise."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class DedupeError(Exception):
    """Something went wrong in dedupe-worker."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__class__.__doc__ or "").strip())


class ConfigurationError(DedupeError):
    """The app, a handler or an option is misconfigured; the message says how to fix it."""


class InvalidOption(ConfigurationError, ValueError):
    """A handler option, or a combination of options, that cannot work as asked; the message
    names the option."""


def unknown_option(where: str, name: str, valid: Iterable[str]) -> InvalidOption:
    """The error for an option nobody defines (a typo): it names the closest valid one."""
    known = sorted(set(valid))
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return InvalidOption(f"{where}: unknown option {name!r} — did you mean {close[0]!r}?")
    return InvalidOption(f"{where}: unknown option {name!r}; the options are {', '.join(known)}")


class SchemaMismatch(ConfigurationError):
    """The database's schema is not the one this dedupe-worker was built for (never migrated,
    migrations pending, or migrated by a newer version); the message says which versions and
    what to run."""


class StoreError(DedupeError):
    """The claim store (PostgreSQL) could not be reached or refused a statement."""


class BrokerUnavailable(DedupeError):
    """The broker could not be reached: nothing was published (not a refusal of the message)."""


class LeaseLost(DedupeError):
    """Another worker took this key over; this run's writes were rolled back."""


class KeyMissing(DedupeError):
    """The message carries no idempotency key where the handler looks for one."""


class InvalidKey(KeyMissing):
    """The idempotency key or scope cannot be stored by the claims table (NUL, invalid
    Unicode, too long): as good as no key; dead-lettered with reason invalid_key."""


class InvalidPayload(DedupeError):
    """The message body could not be decoded into the handler's parameter type."""


class Retry(DedupeError):
    """The handler asks to be run again later (counts as an attempt)."""

    def __init__(self, message: str | None = None, *, delay_s: float | None = None) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class Reject(DedupeError):
    """The handler refuses this message for good: it is dead-lettered with the reason."""

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason
