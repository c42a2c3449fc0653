"""Webhook sources: how a request is verified, keyed and forwarded, pure of HTTP.

A source's verifier (dedupe.webhooks.verifiers) checks the signature or credential and says which
idempotency key and tenant the request carries; the source scopes that key. The receiver
(`consumers/dedupe_receiver/application.py`) claims it in the same claims table the workers use.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from dedupe.claims.fingerprints import RAW, Fingerprint
from dedupe.claims.keys import KeyFunc
from dedupe.claims.values import check_claimable
from dedupe.errors import InvalidPayload, KeyMissing
from dedupe.message import Headers, Message
from dedupe.webhooks.verifiers import Verifier

logger = logging.getLogger("dedupe_receiver")

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
# The forwarded message's header with the sender's idempotency key (the receiver sets it; a
# conflict settled with a new key republishes the body with the new one).
WEBHOOK_KEY_HEADER = "x-dedupe-webhook-key"
# The forwarded message id must fit an AMQP short string (255 bytes) and a Kafka header.
MAX_MESSAGE_ID_BYTES = 255
# The Content-Type is forwarded as the AMQP content_type property, a short string (255 bytes
# at most); media types are ASCII (RFC 9110). Any other value is refused with 415.
MAX_CONTENT_TYPE_BYTES = 255
_CONTENT_TYPE = re.compile(rf"[\t\x20-\x7e]{{0,{MAX_CONTENT_TYPE_BYTES}}}")


@dataclass(frozen=True, slots=True)
class Identity:
    """A verified request's place in the claims table and on the broker."""

    scope: str  # the claim's scope: "<app>.webhook:<source>" plus "/<tenant>"
    key: str  # the caller's idempotency key, as sent
    tenant: str | None
    message_id: str  # "<source>/<tenant>/<key>", the forwarded message's id


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookSource:
    """A registered webhook source: how requests are verified, keyed and forwarded."""

    name: str
    app_name: str
    channel: str
    verify: Verifier = field(repr=False)
    key_spec: str | None
    key_func: KeyFunc | None = field(repr=False)
    content_types: tuple[str, ...]
    max_body_bytes: int
    lease_s: float
    retention_s: float
    fingerprint: Fingerprint = RAW  # what "the same body" is for a key sent again
    keep_payload: bool = False  # keep the first body with its claim, for conflicts

    @property
    def scope(self) -> str:
        """The claims' scope; ':' cannot occur in a handler name, so none collides with it."""
        return f"{self.app_name}.webhook:{self.name}"

    def accepts(self, content_type: str | None) -> bool:
        """Whether the request's media type is one this source takes; never a Content-Type
        over 255 bytes or with characters other than visible ASCII (AMQP cannot carry it)."""
        if content_type is not None and not _CONTENT_TYPE.fullmatch(content_type):
            return False
        if "*/*" in self.content_types:
            return True
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if not media:
            return False
        if media in self.content_types:
            return True
        return "application/json" in self.content_types and (
            media.startswith("application/") and media.endswith("+json")
        )

    def identify(self, headers: Headers, body: bytes) -> Identity:
        """Verify the request and derive its scoped key; VerificationFailed or KeyMissing."""
        verified = self.verify(headers, body)
        key = verified.key
        if self.key_func is not None:
            message = Message(channel=self.channel, body=body, headers=headers)
            try:
                key = self.key_func(message)
            except InvalidPayload as exc:
                raise KeyMissing(f"no idempotency key at {self.key_spec}: {exc}") from exc
            except Exception as exc:
                # The user's key function could not read this (verified) request: the
                # sender's request is refused (400), not answered by a 500. The exception's
                # message stays in our log; the client sees only its class.
                logger.warning(
                    "webhook %s: the key function raised on a request", self.name, exc_info=True
                )
                raise KeyMissing(
                    f"the key function could not read the request ({exc.__class__.__name__})"
                ) from exc
        if not key:
            where = f"at {self.key_spec}" if self.key_spec else f"in {verified.key_from}"
            raise KeyMissing(f"the request carries no idempotency key {where}")
        if not key.isprintable():
            raise KeyMissing("the idempotency key contains control characters")
        tenant = verified.tenant
        scope = self.scope if tenant is None else f"{self.scope}/{tenant}"
        message_id = f"{self.name}/{key}" if tenant is None else f"{self.name}/{tenant}/{key}"
        if len(message_id.encode()) > MAX_MESSAGE_ID_BYTES:
            raise KeyMissing(
                f"the idempotency key is too long: with its source and tenant it must fit "
                f"{MAX_MESSAGE_ID_BYTES} bytes"
            )
        check_claimable(scope, key)  # InvalidKey: the claims table could not hold it (400)
        return Identity(scope=scope, key=key, tenant=tenant, message_id=message_id)


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_MESSAGE_ID_BYTES",
    "WEBHOOK_KEY_HEADER",
    "Identity",
    "WebhookSource",
]
