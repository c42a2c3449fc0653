"""`request.state.idempotency`: what a keyed endpoint gets from the middleware (its
transaction, its key, and the outbox and durable steps of its run)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dedupe.context import Database, Effects
from dedupe.errors import DedupeError


@dataclass(frozen=True, slots=True)
class Idempotency:
    """`request.state.idempotency`: the transaction the response commits in, and the key.

    `publish` and `step` are `ctx.publish` and `ctx.step` for the endpoint: a publish commits
    with the response (in `db`'s transaction) and is relayed by any worker's relay on the same
    claims database; a step's result is recorded under the request's key.
    """

    db: Database
    key: str | None  # None: the request carried no Idempotency-Key (it runs unprotected)
    scope: str | None
    attempt: int = 1  # runs of this key so far, this one included
    effects: Effects | None = None

    async def publish(
        self,
        channel: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Publish through the outbox with the stored response; returns the message id."""
        return await self._effects("publish").publish(channel, body, key=key, headers=headers)

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` once for this key across retries; its JSON result is recorded."""
        return await self._effects("step").step(name, fn, *args, **kwargs)

    def _effects(self, what: str) -> Effects:
        if self.effects is None:
            raise DedupeError(
                f"request.state.idempotency.{what} needs a request with an Idempotency-Key: "
                "without one the request runs unprotected and has no claim to fence it"
            )
        return self.effects


__all__ = ["Idempotency"]
