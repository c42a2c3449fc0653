"""A verified webhook request's way through the claims table and the broker: claim its key,
publish with confirms, store the reply; or, for a key held elsewhere, replay the stored reply,
refuse another body, or ask the sender to come back. A failed publish gives the key back."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.responses import Response

from dedupe.asgi.problems import in_flight, unavailable
from dedupe.claims import conflict_records, conflicts
from dedupe.claims.batching import Batcher
from dedupe.claims.fingerprints import claim_request
from dedupe.claims.records import ClaimRequest, Fence
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import (
    Claims,
    Conflict,
    Duplicate,
    InFlight,
    Ours,
    Terms,
    Unavailable,
    Unclaimable,
    Verdict,
)
from dedupe.errors import InvalidPayload
from dedupe.message import Headers, Message
from dedupe.observability.activity import Activity
from dedupe.observability.metrics import Metrics
from dedupe.transport import Publisher
from dedupe.webhooks import Identity, WebhookSource
from dedupe_receiver.limits import too_large_for_broker
from dedupe_receiver.replies import Reply, accepted, problem, respond

# Every line the receiver logs comes from one logger, whichever module writes it: operators
# and the tests select the receiver's lines by this name.
logger = logging.getLogger("dedupe_receiver")


def log_fields(source: WebhookSource, identity: Identity | None, outcome: str) -> dict[str, str]:
    """The `extra=` of a log line about one request (dedupe.observability.logs prints only
    these)."""
    fields = {"source": source.name, "channel": source.channel, "outcome": outcome}
    if identity is not None:
        fields.update(scope=identity.scope, key=identity.key, message_id=identity.message_id)
    return fields


@dataclass(frozen=True, slots=True)
class Intake:
    """The receiver's open store and publisher, taking one request from claim to reply.

    Concurrent requests' claims share statements per source, as a worker's deliveries do
    (dedupe.claims.verdicts.Claims), and so do their replies: each published request's claim
    is completed with its reply in a statement it shares with the replies of the requests that
    published while the one before ran (dedupe.claims.batching.Batcher, two in flight, as the
    workers complete their runs). A shared statement never waits for a row lock held elsewhere
    (ClaimStore.complete_unlocked skips such a row): that reply alone is then stored in a
    statement of its own, so one locked row holds up no other request. A reply waits at most
    `store_timeout_s`; one that no statement has taken by then is never sent, and either way
    the message is on the broker: the sender has its 202, and a retry after the lease
    publishes it again under the same message id, which the worker behind dedupes.
    """

    store: ClaimStore
    publisher: Publisher
    activity: Activity | None
    stats: collections.Counter[str]
    metrics: Metrics
    publish_timeout_s: float
    store_timeout_s: float
    claims: Claims = field(init=False)
    replies: Batcher[tuple[Fence, str, float], bool | None] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "claims", Claims(self.store))
        object.__setattr__(self, "replies", Batcher(self._complete))

    async def _complete(self, outcomes: Sequence[tuple[Fence, str, float]]) -> list[bool | None]:
        """One shared statement: complete these claims with their replies. Each is True
        (stored), False (the claim is no longer ours) or None: its row was locked by another
        transaction, skipped rather than waited for, and left to its own request."""
        done, locked = await self.store.complete_unlocked(outcomes)
        return [
            True if fence in done else None if fence in locked else False
            for fence, _, _ in outcomes
        ]

    async def claim(
        self, source: WebhookSource, identity: Identity, forward: dict[str, str], body: bytes
    ) -> Response:
        """Claim the key and publish, or answer for the claim someone else holds."""
        # The message as the worker behind us will see it: the source's fingerprint (and a
        # fingerprint function) looks at that.
        message = Message(
            channel=source.channel,
            body=body,
            headers=Headers(forward),
            message_id=identity.message_id,
            content_type=forward.get("content-type"),
        )
        try:
            request = claim_request(
                identity.scope,
                identity.key,
                message,
                source.fingerprint,
                keep_payload=source.keep_payload,
            )
        except InvalidPayload as exc:
            return problem(400, "invalid-payload", "Invalid payload", str(exc))
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.store_timeout_s):
                [verdict] = await self.claims.claim(
                    source.name, Terms(source.lease_s, source.retention_s), [request]
                )
        except Exception as exc:
            # Our timeout, or whatever else the driver raised: an outage of ours. A shared
            # statement that goes on claims for us all the same; Claims gives that key back.
            verdict = Unavailable(f"{exc.__class__.__name__}: {exc}")
        if isinstance(verdict, Unavailable):
            self.stats["store_unavailable"] += 1
            logger.warning(
                "webhook %s: claiming key %s failed (%s)",
                source.name,
                identity.key,
                verdict.error,
                extra=log_fields(source, identity, "store_unavailable"),
            )
            return respond(unavailable("the claim store is unavailable"))
        self.metrics.claimed(source.scope, time.perf_counter() - started, 1)
        if isinstance(verdict, Ours):
            return await self._publish(source, identity, verdict, forward, body)
        if isinstance(verdict, Conflict):
            return await self._conflict(source, identity, verdict, request, message)
        return self._answer_for(source, identity, verdict)

    async def _conflict(
        self,
        source: WebhookSource,
        identity: Identity,
        verdict: Conflict,
        request: ClaimRequest,
        message: Message,
    ) -> Response:
        """Another body under a used key: 422, once its record (both fingerprints, the diff,
        the second body when kept) has committed; 503 when it could not be, so the sender's
        retry records it. Nothing but the record holds that body: nothing was published."""
        report = conflicts.report(
            request,
            message,
            source.fingerprint,
            claimed_fingerprint=verdict.fingerprint,
            claimed_hash=verdict.payload_hash,
            claimed_payload=verdict.payload,
            keep_payload=source.keep_payload,
            source=source.name,
        )
        try:
            async with asyncio.timeout(self.store_timeout_s):
                await conflict_records.record(self.store.pool, [report])
        except Exception as exc:  # StoreError, or our timeout
            self.stats["store_unavailable"] += 1
            logger.warning(
                "webhook %s: recording the conflict of key %s failed (%s)",
                source.name,
                identity.key,
                exc,
                extra=log_fields(source, identity, "store_unavailable"),
            )
            return respond(unavailable("the claim store is unavailable"))
        self.stats["conflicts"] += 1
        if self.activity is not None:
            self.activity.conflict(identity.scope)
        logger.info(
            "webhook %s: key %s reused with another body: 422",
            source.name,
            identity.key,
            extra=log_fields(source, identity, "conflict"),
        )
        return problem(
            422,
            "key-conflict",
            "Idempotency key reused",
            "this idempotency key was used with another body; use a new key",
        )

    def _answer_for(self, source: WebhookSource, identity: Identity, verdict: Verdict) -> Response:
        """The reply to a key we do not own: replay, or come back later."""
        if isinstance(verdict, InFlight):
            self.stats["in_flight"] += 1
            return respond(in_flight())
        if isinstance(verdict, Unclaimable):
            return problem(400, "invalid-key", "Invalid idempotency key", verdict.detail)
        stored = Reply.from_result(verdict.result) if isinstance(verdict, Duplicate) else None
        if stored is None:
            # A finished key of this scope without a stored reply was not completed by a
            # receiver; the publish happened once, so answer as the publish would have.
            stored = accepted(source, identity)
        self.stats["replayed"] += 1
        if self.activity is not None:
            self.activity.duplicate(identity.scope)
        logger.debug(
            "webhook %s: replayed key %s",
            source.name,
            identity.key,
            extra=log_fields(source, identity, "replayed"),
        )
        return stored.response(replayed=True)

    async def _publish(
        self,
        source: WebhookSource,
        identity: Identity,
        ours: Ours,
        forward: dict[str, str],
        body: bytes,
    ) -> Response:
        """Publish with the broker's confirm and store the reply; a failed publish gives the
        key back."""
        fence = ours.fence
        try:
            async with asyncio.timeout(self.publish_timeout_s):
                await self.publisher.publish(
                    source.channel, body, message_id=identity.message_id, headers=forward
                )
        except asyncio.CancelledError:
            await asyncio.shield(self._give_back(fence, ours.attempts))
            raise
        except Exception as exc:
            await self._give_back(fence, ours.attempts)
            return self._not_published(source, identity, fence, exc)
        reply = accepted(source, identity)
        await self._store_reply(source, identity, fence, reply)
        self.stats["accepted"] += 1
        logger.debug(
            "webhook %s: accepted key %s -> %s",
            source.name,
            fence.key,
            source.channel,
            extra=log_fields(source, identity, "accepted"),
        )
        return reply.response()

    def _not_published(
        self, source: WebhookSource, identity: Identity, fence: Fence, exc: Exception
    ) -> Response:
        """The answer to a publish the broker did not confirm: 413 for a message too large for
        it (every retry would fail), else 503 (the key is free for the sender's retry)."""
        if too_large_for_broker(exc):
            self.stats["broker_refused"] += 1
            logger.info(
                "webhook %s: the broker refused key %s for its size (%s): 413",
                source.name,
                fence.key,
                exc.__class__.__name__,
                extra=log_fields(source, identity, "broker_refused"),
            )
            return problem(
                413,
                "payload-too-large",
                "Payload too large",
                "the broker refuses a message this large (body and headers)",
            )
        self.stats["broker_unavailable"] += 1
        logger.warning(
            "webhook %s: publishing to %s failed (%s: %s); key %s released for the sender's retry",
            source.name,
            source.channel,
            exc.__class__.__name__,
            exc,
            fence.key,
            extra=log_fields(source, identity, "broker_unavailable"),
        )
        return respond(
            unavailable("the broker did not confirm the message", slug="broker-unavailable")
        )

    async def _store_reply(
        self, source: WebhookSource, identity: Identity, fence: Fence, reply: Reply
    ) -> None:
        """Complete the claim with the reply to replay, in a statement shared with other
        requests' replies; a failure is logged, not answered."""
        try:
            async with asyncio.timeout(self.store_timeout_s):
                # Cancelled by the timeout before a statement takes it, the reply is never sent.
                outcome = (fence, reply.to_result(), source.retention_s)
                [completed] = await self.replies.submit([outcome])
                if completed is None:  # its row is locked elsewhere: wait for it alone
                    completed = bool(await self.store.complete([outcome]))
        except Exception as exc:
            # The message is on the broker: accepted is the truth. A retry after the lease
            # publishes it again under the same message id, and the worker dedupes that.
            logger.warning(
                "webhook %s: key %s published but its reply was not stored (%s: %s)",
                source.name,
                fence.key,
                exc.__class__.__name__,
                exc,
                extra=log_fields(source, identity, "reply_not_stored"),
            )
            return
        if not completed:
            # Our lease ran out and another request took the key over (it publishes again
            # under the same message id): its reply is the one kept.
            logger.info(
                "webhook %s: key %s published, but its claim was taken over before the reply "
                "was stored",
                source.name,
                fence.key,
                extra=log_fields(source, identity, "reply_not_stored"),
            )

    async def _give_back(self, fence: Fence, attempt: int) -> None:
        """Release the key at once, so the sender's retry takes it over without waiting."""
        try:
            async with asyncio.timeout(self.store_timeout_s):
                await self.store.give_back(fence, attempt=attempt)
        except Exception as exc:
            logger.warning(
                "could not release key %s (%s: %s); its lease expires",
                fence.key,
                exc.__class__.__name__,
                exc,
                extra={"scope": fence.scope, "key": fence.key, "outcome": "not_released"},
            )


__all__ = ["Intake", "log_fields"]
