"""The App and its `@app.handler` decorator: registration is validated on the spot."""

from __future__ import annotations

import inspect
import logging
import re
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Never, TypeVar

from dedupe.claims.fingerprints import RAW, Fingerprint, FingerprintSpec, compile_fingerprint
from dedupe.claims.keys import KeyFunc, KeySpec, compile_key
from dedupe.decoding import Decoder, decoder_for
from dedupe.errors import ConfigurationError, InvalidOption, unknown_option
from dedupe.message import Message
from dedupe.webhooks.sources import DEFAULT_MAX_BODY_BYTES, WebhookSource
from dedupe.webhooks.verifiers import Verifier

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
Hook = Callable[[str, Message, str, str], Awaitable[None]]
H = TypeVar("H", bound=Hook)
STAGES = ("claimed", "handled", "completed")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")
# A webhook source is a URL path segment and the first part of every forwarded message id.
_SOURCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
DAY_S = 86_400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Handler:
    """A registered handler with its options, validated and compiled."""

    name: str
    channel: str
    fn: Callable[..., Awaitable[Any]] = field(repr=False)
    key_spec: str
    key_func: KeyFunc = field(repr=False)
    scope_func: Callable[[Message], str | None] = field(repr=False)
    decode: Decoder = field(repr=False)
    takes_context: bool
    max_attempts: int
    lease_s: float
    timeout_s: float | None
    retry_on: tuple[type[BaseException], ...]
    retention_s: float
    backoff_s: float
    max_backoff_s: float
    group_commit: bool = False
    one_transaction: bool = False
    fingerprint: Fingerprint = RAW
    keep_payload: bool = False

    def scope_of(self, message: Message) -> str | None:
        return self.scope_func(message)


class App:
    """A named set of handlers and webhook sources run by `dedupe-worker`.

    Args:
        name: Prefix of every handler's default scope; keep it stable once keys are stored.
    """

    def __init__(self, name: str) -> None:
        if not _NAME.match(name):
            raise ConfigurationError(
                f"app name {name!r}: use letters, digits, '.', '_' or '-' (it prefixes key scopes)"
            )
        self.name = name
        self.handlers: dict[str, Handler] = {}
        self.hooks: list[tuple[frozenset[str], Hook]] = []
        self.webhooks: dict[str, WebhookSource] = {}

    @property
    def channels(self) -> dict[str, list[Handler]]:
        """Handlers grouped by channel, in registration order."""
        grouped: dict[str, list[Handler]] = {}
        for handler in self.handlers.values():
            grouped.setdefault(handler.channel, []).append(handler)
        return grouped

    def handler(
        self,
        channel: str,
        *,
        key: KeySpec = "message_id",
        scope: KeySpec | None = None,
        name: str | None = None,
        max_attempts: int = 5,
        lease_s: float = 30.0,
        timeout_s: float | None = None,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        retention_s: float = 7 * DAY_S,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        group_commit: bool = False,
        one_transaction: bool = False,
        fingerprint: FingerprintSpec = "raw",
        fingerprint_exclude: tuple[str, ...] = (),
        keep_payload: bool = False,
        **unknown: Never,  # a typo: refused below with the closest name (and by mypy)
    ) -> Callable[[F], F]:
        """Register an async handler for `channel`.

        Args:
            channel: A queue on RabbitMQ, a topic on Kafka.
            key: Where the idempotency key comes from: "message_id", "header:NAME",
                "body:dotted.path", "kafka:offset", a "|"-separated fallback chain, or a
                callable (Message) -> str | None.
            scope: Adds a tenant to the default scope (app.handler): a key spec or callable.
            name: Handler name (default: the function's name); part of the scope.
            max_attempts: Runs before a failing message is dead-lettered.
            lease_s: How long a claim stays ours without a heartbeat.
            timeout_s: Cancel a run after this long (counts as a failed attempt).
            retry_on: Exception types that are transient; others dead-letter at once.
            retention_s: How long a key is remembered after its outcome.
            backoff_s: First retry delay; doubles up to max_backoff_s, with jitter.
            max_backoff_s: Longest delay between two attempts.
            group_commit: Share one transaction and one COMMIT among the runs of several
                messages, each in a savepoint of its own (a failure or a fenced completion
                rolls back only its own writes). The runs of a group go one at a time on its
                connection: for handlers whose ctx.db work is short and that await nothing
                else while it is open.
            one_transaction: For a handler whose only effects go through ctx.db (and
                ctx.publish, stored in the same transaction): a first delivery claims its
                key, runs the handler and records the outcome in ONE transaction (one
                commit instead of two; a duplicate racing it on another worker waits on the
                row lock, then sees the outcome). Redeliveries, keys that already have a
                row, and runs that fail, call ctx.step or outlast the lease (or timeout_s)
                take the two-commit path, where attempts are counted as usual (a failed
                one-transaction run counts as attempt 1). Needs (payload, ctx); not with
                group_commit. See docs/design.md, "One transaction where one is enough".
            fingerprint: What "the same payload" is when a key comes again: "raw" (the body
                bytes), "json" (the JSON value: key order, whitespace and the spelling of
                numbers do not matter) or a callable (Message) -> bytes. Another payload
                under a used key is a conflict: dead-lettered as key_conflict, never run.
            fingerprint_exclude: With "json", dotted body paths left out ("sent_at",
                "meta.trace", "items.*.seen").
            keep_payload: Keep the first payload with its claim (up to 64 KiB, as long as the
                claim) and a conflicting one beside it, so that a conflict shows which paths
                differ and can be settled (`dedupe-worker conflicts settle`).
        """
        for option in unknown:
            named = inspect.signature(App.handler).parameters.values()
            valid = [p.name for p in named if p.kind is p.KEYWORD_ONLY]
            raise unknown_option(f"app.handler({channel!r})", option, valid)

        def register(fn: F) -> F:
            handler_name: str = name or str(getattr(fn, "__name__", ""))
            where = f"handler {handler_name!r}"
            is_async: bool = inspect.iscoroutinefunction(fn)
            if not is_async:
                raise ConfigurationError(f"{where}: must be an `async def` function")
            if not _NAME.match(handler_name):
                raise ConfigurationError(f"{where}: name must match {_NAME.pattern}")
            if handler_name in self.handlers:
                raise ConfigurationError(
                    f"{where}: a handler of that name is already registered on app "
                    f"{self.name!r}; pass name=... to tell them apart"
                )
            if not isinstance(channel, str) or not _NAME.match(channel):
                raise ConfigurationError(f"{where}: channel {channel!r} must match {_NAME.pattern}")
            _check_positive(
                where,
                max_attempts=max_attempts,
                lease_s=lease_s,
                retention_s=retention_s,
                backoff_s=backoff_s,
                max_backoff_s=max_backoff_s,
            )
            if timeout_s is not None:
                _check_positive(where, timeout_s=timeout_s)
            compiled = _fingerprint(where, fingerprint, fingerprint_exclude, keep_payload)
            if not isinstance(max_attempts, int):
                raise ConfigurationError(f"{where}: max_attempts must be an integer")
            if not (
                isinstance(retry_on, tuple)
                and all(isinstance(t, type) and issubclass(t, BaseException) for t in retry_on)
            ):
                raise ConfigurationError(f"{where}: retry_on must be a tuple of exception types")
            horizon_s = max_attempts * (lease_s + max_backoff_s)
            if retention_s <= horizon_s:
                raise ConfigurationError(
                    f"{where}: retention_s={retention_s:g} is shorter than the redelivery "
                    f"horizon ({horizon_s:g} s = max_attempts x (lease_s + max_backoff_s)); a key "
                    "could be forgotten while its message is still being redelivered"
                )
            if retention_s < DAY_S:
                logger.warning(
                    "%s: retention_s=%g is under a day; brokers and webhook senders may "
                    "redeliver later than that",
                    where,
                    retention_s,
                )

            params = list(inspect.signature(fn).parameters.values())
            if not 1 <= len(params) <= 2:
                raise ConfigurationError(
                    f"{where}: takes (payload) or (payload, ctx: Context), not {len(params)} "
                    "parameters"
                )
            try:
                hints = typing.get_type_hints(fn)
            except Exception as exc:
                raise ConfigurationError(f"{where}: cannot resolve annotations: {exc}") from exc
            decode = decoder_for(hints.get(params[0].name, inspect.Parameter.empty), where)
            if not isinstance(group_commit, bool):
                raise ConfigurationError(f"{where}: group_commit must be True or False")
            if group_commit and len(params) != 2:
                raise ConfigurationError(
                    f"{where}: group_commit=True groups ctx.db transactions; the handler must "
                    "take (payload, ctx: Context)"
                )

            if not isinstance(one_transaction, bool):
                raise InvalidOption(f"{where}: one_transaction must be True or False")
            if one_transaction and len(params) != 2:
                raise InvalidOption(
                    f"{where}: one_transaction=True runs the claim, the handler's ctx.db writes "
                    "and the completion in one transaction; a handler without ctx has nothing "
                    "to write through it: take (payload, ctx: Context) or drop the option"
                )
            if one_transaction and group_commit:
                raise InvalidOption(
                    f"{where}: one_transaction=True and group_commit=True exclude each other "
                    "(one transaction per first delivery, or one shared by a group of runs "
                    "after their claims): pick one"
                )

            key_func = compile_key(key)
            base_scope = f"{self.name}.{handler_name}"
            scope_func = _compile_scope(base_scope, scope)
            self.handlers[handler_name] = Handler(
                name=handler_name,
                channel=channel,
                fn=fn,
                key_spec=key if isinstance(key, str) else getattr(key, "__name__", "callable"),
                key_func=key_func,
                scope_func=scope_func,
                decode=decode,
                takes_context=len(params) == 2,
                max_attempts=max_attempts,
                lease_s=float(lease_s),
                timeout_s=None if timeout_s is None else float(timeout_s),
                retry_on=retry_on,
                retention_s=float(retention_s),
                backoff_s=float(backoff_s),
                max_backoff_s=float(max_backoff_s),
                group_commit=group_commit,
                one_transaction=one_transaction,
                fingerprint=compiled,
                keep_payload=keep_payload,
            )
            return fn

        return register

    def webhook(
        self,
        source: str,
        *,
        verify: Verifier,
        channel: str,
        key: KeySpec | None = None,
        content_types: tuple[str, ...] = ("application/json",),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        lease_s: float = 10.0,
        retention_s: float = 7 * DAY_S,
        fingerprint: FingerprintSpec = "raw",
        fingerprint_exclude: tuple[str, ...] = (),
        keep_payload: bool = False,
    ) -> WebhookSource:
        """Declare a webhook source, served by `dedupe-worker receive` at POST /webhooks/<source>.

        Args:
            source: Name in the URL and first part of every forwarded message id.
            verify: A verifier from dedupe.webhooks: standard_webhooks(...), github(...),
                stripe(...) or api_key(...).
            channel: Where verified requests are published (a queue or a topic).
            key: Overrides the verifier's idempotency key: "header:NAME", "body:path", ...
            content_types: Media types accepted (others get 415); ("*/*",) takes any.
            max_body_bytes: Larger bodies get 413 before they are read in full.
            lease_s: How long a request holds its key while publishing.
            retention_s: How long a key and its stored response are remembered; longer than
                the sender retries (Stripe: 3 days).
            fingerprint, fingerprint_exclude, keep_payload: As on app.handler; another body
                under a used key is answered 422.
        """
        where = f"webhook source {source!r}"
        if not isinstance(source, str) or not _SOURCE.match(source):
            raise ConfigurationError(f"{where}: name must match {_SOURCE.pattern}")
        if source in self.webhooks:
            raise ConfigurationError(
                f"{where}: a source of that name is already declared on app {self.name!r}"
            )
        if not isinstance(channel, str) or not _NAME.match(channel):
            raise ConfigurationError(f"{where}: channel {channel!r} must match {_NAME.pattern}")
        if not callable(verify) or not callable(getattr(verify, "check", None)):
            raise ConfigurationError(
                f"{where}: verify= takes a verifier from dedupe.webhooks, e.g. "
                "github(secret=env('GITHUB_WEBHOOK_SECRET'))"
            )
        if (
            not isinstance(content_types, tuple)
            or not content_types
            or not all(isinstance(t, str) and "/" in t for t in content_types)
        ):
            raise ConfigurationError(
                f"{where}: content_types must be a tuple of media types like 'application/json'"
            )
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool):
            raise ConfigurationError(f"{where}: max_body_bytes must be an integer")
        _check_positive(
            where, max_body_bytes=max_body_bytes, lease_s=lease_s, retention_s=retention_s
        )
        compiled = _fingerprint(where, fingerprint, fingerprint_exclude, keep_payload)
        if retention_s < DAY_S:
            logger.warning(
                "%s: retention_s=%g is under a day; senders retry for days (Stripe: 3)",
                where,
                retention_s,
            )
        webhook = WebhookSource(
            name=source,
            app_name=self.name,
            channel=channel,
            verify=verify,
            key_spec=None if key is None else (key if isinstance(key, str) else "callable"),
            key_func=None if key is None else compile_key(key),
            content_types=tuple(t.lower() for t in content_types),
            max_body_bytes=max_body_bytes,
            lease_s=float(lease_s),
            retention_s=float(retention_s),
            fingerprint=compiled,
            keep_payload=keep_payload,
        )
        self.webhooks[source] = webhook
        return webhook

    def hook(self, *stages: str) -> Callable[[H], H]:
        """Register `async def hook(stage, message, scope, key)` to run at pipeline stages.

        Stages: "claimed" (the key is ours, the handler has not run), "handled" (the handler
        returned, its outcome is not recorded yet) and "completed" (the outcome is committed,
        the broker not yet told). For tracing, metrics and fault injection in tests; an
        exception raised by a hook counts as a failure of the run.
        """
        unknown = set(stages) - set(STAGES)
        if not stages or unknown:
            raise ConfigurationError(
                f"hook stages must be among {', '.join(STAGES)}; got {sorted(unknown) or 'none'}"
            )

        def register(fn: H) -> H:
            is_async: bool = inspect.iscoroutinefunction(fn)
            if not is_async:
                raise ConfigurationError(f"hook {fn!r}: must be an `async def` function")
            self.hooks.append((frozenset(stages), fn))
            return fn

        return register

    def __repr__(self) -> str:
        webhooks = f", webhooks={sorted(self.webhooks)}" if self.webhooks else ""
        return f"App({self.name!r}, handlers={sorted(self.handlers)}{webhooks})"


def _check_positive(where: str, **values: float) -> None:
    for option, value in values.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ConfigurationError(f"{where}: {option} must be a positive number, got {value!r}")


def _fingerprint(
    where: str, spec: FingerprintSpec, exclude: tuple[str, ...], keep_payload: object
) -> Fingerprint:
    if not isinstance(keep_payload, bool):
        raise ConfigurationError(f"{where}: keep_payload must be True or False")
    return compile_fingerprint(spec, exclude=exclude, where=where)


def _compile_scope(base: str, spec: KeySpec | None) -> Callable[[Message], str | None]:
    if spec is None:
        return lambda message: base
    tenant_of = compile_key(spec)

    def scope_of(message: Message) -> str | None:
        tenant = tenant_of(message)
        return f"{base}/{tenant}" if tenant else None

    return scope_of


__all__ = ["App", "Handler"]
