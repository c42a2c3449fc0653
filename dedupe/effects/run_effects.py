"""What a run does beyond its return value: `ctx.publish` (through the outbox, in the completion
transaction) and `ctx.step` (a durable step, recorded under the claim as soon as it returns)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import asyncpg
import pydantic
import pydantic_core

from dedupe.claims.database import TRANSIENT_ERRORS
from dedupe.claims.records import Fence
from dedupe.claims.values import step_json
from dedupe.context import Database
from dedupe.effects.outbox import Outgoing, with_trace_context
from dedupe.errors import DedupeError, LeaseLost, StoreError
from dedupe.sql import queries

T = TypeVar("T")

# Message ids derived for publishes without key=: stable across attempts (the scope, the key,
# the channel and the publish's place among this run's publishes to that channel).
_NAMESPACE = uuid.UUID("6f4b1b64-3c0e-4a3e-9d56-7a1f1f0a9d11")
MAX_STEP_NAME = 200


class StepError(DedupeError):
    """A durable step was misused: its name, or a result that is not JSON."""


def encode_body(body: Any) -> tuple[bytes, str | None]:
    """A publish's body as bytes, the same every time for the same value."""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body), None
    if isinstance(body, pydantic.BaseModel):
        return body.model_dump_json().encode(), "application/json"
    try:
        return pydantic_core.to_json(body).decode().encode(), "application/json"
    except pydantic_core.PydanticSerializationError as exc:
        raise DedupeError(f"ctx.publish: the body is not bytes, a model or JSON ({exc})") from exc


def _check_storable(what: str, text: str) -> None:
    """Refuse at the call what the outbox table cannot hold: a completion that failed on it
    would fail again at every delivery of the message."""
    if "\x00" in text:
        raise DedupeError(f"ctx.publish: {what} holds a NUL character, which PostgreSQL refuses")
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise DedupeError(f"ctx.publish: {what} is not UTF-8 text ({exc.reason})") from exc


def _run_over() -> None:
    """RunEffects' cancel once its run is over: there is nothing left to cancel."""


class RunEffects:
    """The publishes and steps of one run of a claim (one attempt)."""

    def __init__(self, db: Database, fence: Fence, *, cancel: Callable[[], None]) -> None:
        self.db = db
        self.fence = fence
        self.outgoing: list[Outgoing] = []
        # A ctx.db.transaction() block rolled back takes its publishes back with its writes.
        db.on_block(self._mark)
        self._counts: collections.Counter[str] = collections.Counter()
        self._cancel = cancel

    def end(self) -> None:
        """The run is over: a step still running in a task the run left behind cancels
        nothing, and the effects no longer refer to the run. (They outlive it where the request
        is kept: `request.state.idempotency` in the scope, which the server's `send` holds, and
        the run holds `send`, a cycle per request that only the cyclic GC would free.)"""
        self._cancel = _run_over

    def _mark(self) -> Callable[[], None]:
        published = len(self.outgoing)

        def undo() -> None:
            del self.outgoing[published:]

        return undo

    async def publish(
        self,
        channel: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        if not isinstance(channel, str) or not channel:
            raise DedupeError("ctx.publish: the channel must be a non-empty string")
        texts = [("the channel", channel), ("the key", key or "")]
        for name, value in (headers or {}).items():
            texts += [("a header name", str(name)), (f"header {name!r}", str(value))]
        for what, text in texts:
            _check_storable(what, text)
        data, content_type = encode_body(body)
        position = self._counts[channel]
        self._counts[channel] += 1
        message_id = key or str(
            uuid.uuid5(
                _NAMESPACE, "\x1f".join((self.fence.scope, self.fence.key, channel, str(position)))
            )
        )
        self.outgoing.append(
            Outgoing(
                producer=f"{self.fence.scope}\x1f{self.fence.key}",
                channel=channel,
                message_id=message_id,
                body=data,
                headers=with_trace_context({str(k): str(v) for k, v in (headers or {}).items()}),
                content_type=content_type,
            )
        )
        return message_id

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME or "\x00" in name:
            raise StepError(f"ctx.step: a step name is 1-{MAX_STEP_NAME} characters of text")
        [looked] = await self._fetch(
            "step_result", self.fence.scope, self.fence.key, name, self.fence.token
        )
        if not looked["ours"]:  # another worker took the key over: this run is a zombie
            self._cancel()
            raise LeaseLost()
        if looked["result"] is not None:
            return json.loads(looked["result"])
        if inspect.iscoroutinefunction(fn):
            value = await fn(*args, **kwargs)
        else:
            value = await asyncio.to_thread(fn, *args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        try:
            text = step_json(value)
        except ValueError as exc:
            raise StepError(f"ctx.step({name!r}): {exc}") from exc
        stored = await self._fetch(
            "record_step", self.fence.scope, self.fence.key, name, self.fence.token, text
        )
        if stored:  # as jsonb keeps it (its number spelling, its key order): what retries get
            return json.loads(stored[0]["result"])
        if not stored:
            [again] = await self._fetch(
                "step_result", self.fence.scope, self.fence.key, name, self.fence.token
            )
            if not again["ours"]:  # taken over while the step ran: its record is refused
                self._cancel()
                raise LeaseLost()
            if again["result"] is not None:  # the same step run twice at once by this run
                return json.loads(again["result"])
        return json.loads(text)

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        try:
            return list(await self.db.pool.fetch(queries("outbox.sql")[name], *args))
        except (*TRANSIENT_ERRORS, asyncpg.PostgresError) as exc:
            raise StoreError(f"ctx.step: {name} failed: {exc.__class__.__name__}: {exc}") from exc


__all__ = ["RunEffects", "StepError", "encode_body"]
