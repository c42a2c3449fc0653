"""Webhook verifiers (Standard Webhooks, GitHub, Stripe, API keys): pure, no HTTP.

A verifier is a function of (headers, raw body): it checks a request's signature or credential
in constant time and says which idempotency key (and, for API keys, which tenant) the request
carries. Import them from dedupe.webhooks, beside the sources they verify for.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dedupe.errors import ConfigurationError, DedupeError, KeyMissing
from dedupe.message import Headers

DEFAULT_TOLERANCE_S = 300.0
# More signatures than this in one header is not key rotation; refuse instead of hashing on.
MAX_SIGNATURES = 16
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_HEX_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")

Clock = Callable[[], float]
Secrets = str | Sequence[str] | Callable[[], "str | Sequence[str]"]
ApiKeys = Mapping[str, str] | Sequence[str]


class VerificationFailed(DedupeError):
    """The request's signature or credential is missing, malformed, stale or wrong."""


@dataclass(frozen=True, slots=True)
class Verified:
    """What a verifier vouches for: the idempotency key (None when the request has none
    where the scheme puts it) and the tenant the caller authenticated as (None: no tenants)."""

    key: str | None
    tenant: str | None = None
    key_from: str = ""  # where the scheme puts the key, for the 400's message


class Verifier(Protocol):
    """Checks one request; raises VerificationFailed (401), or KeyMissing (400) when the
    key is part of what is signed."""

    def __call__(self, headers: Headers, body: bytes) -> Verified: ...

    def check(self) -> None:
        """Resolve the secrets now; raise ConfigurationError when they are missing or bad."""
        ...

    @property
    def challenge(self) -> str | None:
        """The WWW-Authenticate value of a 401, if the scheme has one."""
        ...


def env(name: str) -> Callable[[], str]:
    """A secret read from the environment each time it is needed (never at import time)."""

    def read() -> str:
        value = os.environ.get(name, "")
        if not value:
            raise ConfigurationError(f"set the environment variable {name} (a webhook secret)")
        return value

    read.__name__ = f"env({name})"
    return read


def _resolve(source: Secrets, what: str) -> tuple[str, ...]:
    value = source() if callable(source) else source
    values = (value,) if isinstance(value, str) else tuple(value)
    if not values or not all(isinstance(v, str) and v for v in values):
        raise ConfigurationError(f"{what}: the secret is empty; pass a non-empty string")
    return values


def _b(text: str) -> bytes:
    """The header's bytes as they were sent: ASGI servers decode header values as latin-1."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        # Not from an HTTP server (a caller's own str): the sender would have sent UTF-8.
        return text.encode("utf-8", "replace")


def _key_text(text: str | None) -> str | None:
    """A key header as the sender wrote it: its bytes (see `_b`) read as UTF-8.

    The latin-1 text an ASGI server hands over turns UTF-8 into C1 control characters,
    which the key check would refuse for good; bytes that are not UTF-8 stay as they came.
    """
    if not text:
        return None
    try:
        return _b(text).decode("utf-8")
    except UnicodeDecodeError:
        return text


def _hmac_sha256(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def _check_timestamp(raw: str, *, now: float, tolerance_s: float) -> bytes:
    if not _TIMESTAMP.match(raw):
        raise VerificationFailed("the signature timestamp is not a Unix time in seconds")
    if abs(now - int(raw)) > tolerance_s:
        raise VerificationFailed(
            f"the signature timestamp is more than {tolerance_s:g} s away from the "
            "receiver's clock (a replayed or delayed request, or a skewed clock)"
        )
    return raw.encode()


@functools.lru_cache(maxsize=64)
def _whsec_key(secret: str) -> bytes:
    encoded = secret.removeprefix("whsec_")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigurationError(
            "a Standard Webhooks secret is 'whsec_' followed by base64; this one is not"
        ) from exc


@dataclass(frozen=True, slots=True)
class _StandardWebhooks:
    secret: Secrets = field(repr=False)
    tolerance_s: float
    clock: Clock = field(repr=False)
    challenge: str | None = None

    def check(self) -> None:
        for secret in _resolve(self.secret, "standard_webhooks"):
            _whsec_key(secret)

    def __call__(self, headers: Headers, body: bytes) -> Verified:
        signature = headers.get("webhook-signature", "")
        timestamp = headers.get("webhook-timestamp", "")
        if not signature or not timestamp:
            raise VerificationFailed("webhook-signature and webhook-timestamp are required")
        msg_id = headers.get("webhook-id", "")
        if not msg_id:
            raise KeyMissing("the webhook-id header (the idempotency key) is missing")
        ts = _check_timestamp(timestamp, now=self.clock(), tolerance_s=self.tolerance_s)
        candidates = _standard_signatures(signature)
        for secret in _resolve(self.secret, "standard_webhooks"):
            expected = _hmac_sha256(_whsec_key(secret), _b(msg_id), b".", ts, b".", body)
            # Every candidate is compared: which one matched must not show in the timing.
            matched = False
            for candidate in candidates:
                matched |= hmac.compare_digest(expected, candidate)
            if matched:
                return Verified(key=_key_text(msg_id))
        raise VerificationFailed("no webhook-signature matches the body")


def _standard_signatures(header: str) -> list[bytes]:
    """The v1 signatures of a webhook-signature header ("v1,<b64> v1,<b64>"), decoded."""
    found: list[bytes] = []
    for item in header.split()[: MAX_SIGNATURES * 2]:
        version, _, encoded = item.partition(",")
        if version != "v1" or not encoded:
            continue  # v1a (asymmetric) and future versions are not ours to check
        try:
            found.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    if not found:
        raise VerificationFailed("webhook-signature holds no v1 signature")
    return found[:MAX_SIGNATURES]


def standard_webhooks(
    *, secret: Secrets, tolerance_s: float = DEFAULT_TOLERANCE_S, clock: Clock = time.time
) -> Verifier:
    """Verify Standard Webhooks (webhook-id, webhook-timestamp, webhook-signature).

    Args:
        secret: "whsec_<base64>", several during a rotation, or a callable such as env("NAME").
        tolerance_s: Largest accepted distance of webhook-timestamp from now, either way.
        clock: Seconds since the epoch (tests pass a fixed one).
    """
    return _StandardWebhooks(secret, float(tolerance_s), clock)


@dataclass(frozen=True, slots=True)
class _GitHub:
    secret: Secrets = field(repr=False)
    challenge: str | None = None

    def check(self) -> None:
        _resolve(self.secret, "github")

    def __call__(self, headers: Headers, body: bytes) -> Verified:
        scheme, _, signature = headers.get("x-hub-signature-256", "").partition("=")
        if scheme != "sha256" or not _HEX_SHA256.match(signature):
            raise VerificationFailed("X-Hub-Signature-256 is missing or not 'sha256=<hex>'")
        candidate = _b(signature.lower())
        matched = False
        for secret in _resolve(self.secret, "github"):
            expected = _hmac_sha256(secret.encode(), body).hex().encode()
            matched |= hmac.compare_digest(expected, candidate)
        if not matched:
            raise VerificationFailed("X-Hub-Signature-256 does not match the body")
        return Verified(
            key=_key_text(headers.get("x-github-delivery")), key_from="the X-GitHub-Delivery header"
        )


def github(*, secret: Secrets) -> Verifier:
    """Verify GitHub's X-Hub-Signature-256; the key is X-GitHub-Delivery.

    Args:
        secret: The webhook's secret, several while you rotate it, or a callable.
    """
    return _GitHub(secret)


@dataclass(frozen=True, slots=True)
class _Stripe:
    secret: Secrets = field(repr=False)
    tolerance_s: float
    clock: Clock = field(repr=False)
    challenge: str | None = None

    def check(self) -> None:
        _resolve(self.secret, "stripe")

    def __call__(self, headers: Headers, body: bytes) -> Verified:
        timestamp, candidates = _stripe_header(headers.get("stripe-signature", ""))
        ts = _check_timestamp(timestamp, now=self.clock(), tolerance_s=self.tolerance_s)
        matched = False
        for secret in _resolve(self.secret, "stripe"):
            # Stripe keys the HMAC with the whole secret string, "whsec_" included.
            expected = _hmac_sha256(secret.encode(), ts, b".", body).hex().encode()
            for candidate in candidates:
                matched |= hmac.compare_digest(expected, candidate)
        if not matched:
            raise VerificationFailed("no v1 signature of Stripe-Signature matches the body")
        try:
            event = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            event = None  # not a JSON object: the request carries no key (400)
        key = event.get("id") if isinstance(event, dict) else None
        return Verified(
            key=key if isinstance(key, str) and key else None,
            key_from="the event's string 'id' in a JSON body",
        )


def _stripe_header(header: str) -> tuple[str, list[bytes]]:
    """The t= and v1= parts of a Stripe-Signature header ("t=..,v1=..,v1=..,v0=..")."""
    timestamps: list[str] = []
    signatures: list[bytes] = []
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if name == "t":
            timestamps.append(value)
        elif name == "v1" and _HEX_SHA256.match(value):
            signatures.append(_b(value.lower()))
    if len(timestamps) != 1 or not signatures:
        raise VerificationFailed("Stripe-Signature needs one t= and at least one v1= signature")
    if len(signatures) > MAX_SIGNATURES:
        raise VerificationFailed("Stripe-Signature holds too many signatures")
    return timestamps[0], signatures


def stripe(
    *, secret: Secrets, tolerance_s: float = DEFAULT_TOLERANCE_S, clock: Clock = time.time
) -> Verifier:
    """Verify Stripe-Signature (t=, v1=); the key is the event's "id" in the body.

    Args:
        secret: The endpoint's signing secret ("whsec_..."), several while rotating, or a
            callable.
        tolerance_s: Largest accepted distance of t= from now, either way.
        clock: Seconds since the epoch (tests pass a fixed one).
    """
    return _Stripe(secret, float(tolerance_s), clock)


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _tenant_of_hash(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class _ApiKey:
    keys: ApiKeys | Callable[[], ApiKeys] = field(repr=False)
    key_header: str
    challenge: str | None = 'Bearer realm="dedupe-worker"'

    def _table(self) -> list[tuple[bytes, str]]:
        keys = self.keys() if callable(self.keys) else self.keys
        if isinstance(keys, str):
            raise ConfigurationError("api_key: pass a mapping {key: tenant} or a list of keys")
        if isinstance(keys, Mapping):
            pairs = list(keys.items())
        else:
            pairs = [(key, _tenant_of_hash(key)) for key in keys]
        if not pairs:
            raise ConfigurationError("api_key: no API keys are configured")
        for key, tenant in pairs:
            if not isinstance(key, str) or not key:
                raise ConfigurationError("api_key: every API key must be a non-empty string")
            if not isinstance(tenant, str) or not _TENANT.match(tenant):
                raise ConfigurationError(
                    f"api_key: tenant {tenant!r} must match {_TENANT.pattern} (it is part of "
                    "every key's scope)"
                )
        return [(_key_digest(key), tenant) for key, tenant in pairs]

    def check(self) -> None:
        self._table()

    def __call__(self, headers: Headers, body: bytes) -> Verified:
        presented = _presented_key(headers)
        if presented is None:
            raise VerificationFailed("an API key is required: Authorization: Bearer <key>")
        # Compare digests of equal length against every configured key, without stopping
        # at the first match, so the timing says nothing about which key came close.
        digest = _key_digest(presented)
        tenant: str | None = None
        for known, name in self._table():
            if hmac.compare_digest(known, digest):
                tenant = name
        if tenant is None:
            raise VerificationFailed("the API key is not valid")
        return Verified(
            key=_key_text(headers.get(self.key_header)),
            tenant=tenant,
            key_from=f"the {self.key_header} header",
        )


def _presented_key(headers: Headers) -> str | None:
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    direct = headers.get("x-api-key", "").strip()
    return direct or None


def api_key(
    keys: ApiKeys | Callable[[], ApiKeys], *, key_header: str = "Idempotency-Key"
) -> Verifier:
    """Authenticate `Authorization: Bearer <key>` (or X-API-Key); the key is Idempotency-Key.

    Keys are scoped by tenant: with a mapping {api_key: tenant} the tenant is the name you
    give (so a rotated key keeps its tenant's keys); with a list of keys it is "key-" plus
    16 hex digits of the key's SHA-256 (never the key itself).

    Args:
        keys: {api_key: tenant}, a list of API keys, or a callable returning either.
        key_header: The request header carrying the idempotency key.
    """
    return _ApiKey(keys, key_header)


__all__ = [
    "VerificationFailed",
    "Verified",
    "Verifier",
    "api_key",
    "env",
    "github",
    "standard_webhooks",
    "stripe",
]
