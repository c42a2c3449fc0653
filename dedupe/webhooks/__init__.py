"""dedupe.webhooks: webhook sources and their verifiers, pure of HTTP.

    from dedupe.webhooks import api_key, github, standard_webhooks, stripe

A source says how a request is verified, keyed and forwarded (sources); a verifier checks a
request's signature or credential in constant time and says which idempotency key and tenant
it carries (verifiers). The HTTP server is the receiver's (`dedupe_receiver`).
"""

from __future__ import annotations

from dedupe.webhooks.sources import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_MESSAGE_ID_BYTES,
    WEBHOOK_KEY_HEADER,
    Identity,
    WebhookSource,
)
from dedupe.webhooks.verifiers import (
    VerificationFailed,
    Verified,
    Verifier,
    api_key,
    env,
    github,
    standard_webhooks,
    stripe,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_MESSAGE_ID_BYTES",
    "WEBHOOK_KEY_HEADER",
    "Identity",
    "VerificationFailed",
    "Verified",
    "Verifier",
    "WebhookSource",
    "api_key",
    "env",
    "github",
    "standard_webhooks",
    "stripe",
]
