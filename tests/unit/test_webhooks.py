"""Webhook verifiers: the providers' published vectors, tolerance edges, rotation, API keys."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest

from dedupe import App
from dedupe.errors import ConfigurationError, KeyMissing
from dedupe.message import Headers
from dedupe.webhooks import (
    VerificationFailed,
    api_key,
    env,
    github,
    standard_webhooks,
    stripe,
)

# The Standard Webhooks specification's example (also the test of its reference libraries).
SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SW_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SW_TIMESTAMP = 1614265330
SW_BODY = b'{"test": 2432232314}'
SW_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

# GitHub's documented example ("Validating webhook deliveries").
GH_SECRET = "It's a Secret to Everybody"
GH_BODY = b"Hello, World!"
GH_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"

STRIPE_SECRET = "whsec_test_secret"
NOW = 1_700_000_000


def sw_headers(*, signature: str = SW_SIGNATURE, timestamp: int = SW_TIMESTAMP) -> Headers:
    return Headers(
        {"webhook-id": SW_ID, "webhook-timestamp": str(timestamp), "webhook-signature": signature}
    )


def sw_sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def stripe_header(timestamp: int, body: bytes, *secrets: str) -> str:
    sigs = [
        hmac.new(s.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
        for s in secrets
    ]
    return ",".join([f"t={timestamp}", *(f"v1={sig}" for sig in sigs)])


STRIPE_BODY = json.dumps({"id": "evt_1", "type": "charge.succeeded"}).encode()


# -- Standard Webhooks -------------------------------------------------------------------


def test_the_standard_webhooks_vector_verifies_and_yields_webhook_id_as_key() -> None:
    """The specification's example signature is accepted; the key is webhook-id."""
    verify = standard_webhooks(secret=SW_SECRET, clock=lambda: SW_TIMESTAMP)
    verified = verify(sw_headers(), SW_BODY)
    assert (verified.key, verified.tenant) == (SW_ID, None)


def test_a_changed_body_or_secret_fails_the_standard_webhooks_vector() -> None:
    """One byte more, or another secret, and the signature no longer matches."""
    verify = standard_webhooks(secret=SW_SECRET, clock=lambda: SW_TIMESTAMP)
    with pytest.raises(VerificationFailed):
        verify(sw_headers(), SW_BODY + b" ")
    other = standard_webhooks(
        secret="whsec_" + base64.b64encode(b"another").decode(), clock=lambda: SW_TIMESTAMP
    )
    with pytest.raises(VerificationFailed):
        other(sw_headers(), SW_BODY)


@pytest.mark.parametrize(
    ("offset_s", "accepted"),
    [(0, True), (299, True), (-299, True), (300, True), (-300, True), (301, False), (-301, False)],
)
def test_standard_webhooks_tolerates_300_seconds_either_way(offset_s: int, accepted: bool) -> None:
    """A timestamp 299 s old or ahead is accepted; 301 s in either direction is refused."""
    verify = standard_webhooks(secret=SW_SECRET, clock=lambda: SW_TIMESTAMP + offset_s)
    if accepted:
        assert verify(sw_headers(), SW_BODY).key == SW_ID
    else:
        with pytest.raises(VerificationFailed, match="300 s"):
            verify(sw_headers(), SW_BODY)


def test_a_rotation_header_with_one_bad_and_one_good_signature_is_accepted() -> None:
    """During a key rotation the sender signs twice; one good signature is enough."""
    verify = standard_webhooks(secret=SW_SECRET, clock=lambda: SW_TIMESTAMP)
    bad = "v1," + base64.b64encode(b"x" * 32).decode()
    for header in (f"{bad} {SW_SIGNATURE}", f"{SW_SIGNATURE} {bad}", f"v1a,abc {SW_SIGNATURE}"):
        assert verify(sw_headers(signature=header), SW_BODY).key == SW_ID
    with pytest.raises(VerificationFailed):
        verify(sw_headers(signature=f"{bad} {bad}"), SW_BODY)


def test_the_receiver_side_may_hold_two_secrets_while_rotating() -> None:
    """secret=[old, new] accepts requests signed with either."""
    new = "whsec_" + base64.b64encode(b"new secret").decode()
    verify = standard_webhooks(secret=[new, SW_SECRET], clock=lambda: SW_TIMESTAMP)
    assert verify(sw_headers(), SW_BODY).key == SW_ID
    signed_new = sw_sign(new, SW_ID, SW_TIMESTAMP, SW_BODY)
    assert verify(sw_headers(signature=signed_new), SW_BODY).key == SW_ID


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"webhook-id": SW_ID, "webhook-timestamp": str(SW_TIMESTAMP)},
        {"webhook-id": SW_ID, "webhook-signature": SW_SIGNATURE},
        {"webhook-id": SW_ID, "webhook-timestamp": "1e9", "webhook-signature": SW_SIGNATURE},
        {"webhook-id": SW_ID, "webhook-timestamp": " 1614265330", "webhook-signature": "v1"},
        {"webhook-id": SW_ID, "webhook-timestamp": str(SW_TIMESTAMP), "webhook-signature": "v1,"},
        {"webhook-id": SW_ID, "webhook-timestamp": str(SW_TIMESTAMP), "webhook-signature": "é"},
    ],
)
def test_malformed_standard_webhooks_headers_are_unauthenticated(headers: dict[str, str]) -> None:
    """Missing or malformed signature headers raise VerificationFailed, nothing else."""
    verify = standard_webhooks(secret=SW_SECRET, clock=lambda: SW_TIMESTAMP)
    with pytest.raises(VerificationFailed):
        verify(Headers(headers), SW_BODY)


def test_a_missing_webhook_id_is_a_missing_key() -> None:
    """webhook-id is the idempotency key: without it the request is a 400, not a 401."""
    verify = standard_webhooks(secret=SW_SECRET, clock=lambda: SW_TIMESTAMP)
    headers = {"webhook-timestamp": str(SW_TIMESTAMP), "webhook-signature": SW_SIGNATURE}
    with pytest.raises(KeyMissing):
        verify(Headers(headers), SW_BODY)


def test_a_non_ascii_webhook_id_verifies_on_the_bytes_the_sender_signed() -> None:
    """The sender signs the id's UTF-8 bytes; an ASGI server hands them over as latin-1 text,
    which is turned back into the same bytes (not re-encoded as UTF-8), and the key is the
    id the sender wrote."""
    verify = standard_webhooks(secret=SW_SECRET, clock=lambda: SW_TIMESTAMP)
    msg_id = "msg_ключ_é"
    signature = sw_sign(SW_SECRET, msg_id, SW_TIMESTAMP, SW_BODY)
    as_served = msg_id.encode().decode("latin-1")  # what Starlette's request.headers holds
    headers = {"webhook-timestamp": str(SW_TIMESTAMP), "webhook-signature": signature}
    verified = verify(Headers({**headers, "webhook-id": as_served}), SW_BODY)
    assert verified.key == msg_id and verified.key.isprintable()
    # A caller's own str that never went through latin-1 is taken as the sender's UTF-8.
    assert verify(Headers({**headers, "webhook-id": msg_id}), SW_BODY).key == msg_id
    with pytest.raises(VerificationFailed):
        verify(Headers({**headers, "webhook-id": as_served + "x"}), SW_BODY)


def test_a_secret_that_is_not_base64_is_a_configuration_error() -> None:
    """check() says so when the receiver starts."""
    with pytest.raises(ConfigurationError, match="base64"):
        standard_webhooks(secret="whsec_not base64!").check()


# -- GitHub --------------------------------------------------------------------------------


def test_the_github_vector_verifies_and_yields_the_delivery_as_key() -> None:
    """GitHub's documented example signature is accepted; the key is X-GitHub-Delivery."""
    headers = Headers({"X-Hub-Signature-256": GH_SIGNATURE, "X-GitHub-Delivery": "d-1"})
    assert github(secret=GH_SECRET)(headers, GH_BODY).key == "d-1"
    upper = Headers({"X-Hub-Signature-256": GH_SIGNATURE.upper().replace("SHA256", "sha256")})
    assert github(secret=GH_SECRET)(upper, GH_BODY).key is None
    source = App("a").webhook("gh", verify=github(secret=GH_SECRET), channel="c")
    with pytest.raises(KeyMissing, match="X-GitHub-Delivery"):
        source.identify(upper, GH_BODY)


@pytest.mark.parametrize(
    "signature",
    ["", "sha256=", "sha1=" + "0" * 40, GH_SIGNATURE[:-1], GH_SIGNATURE[:-1] + "f", "sha256=zz"],
)
def test_a_wrong_github_signature_is_unauthenticated(signature: str) -> None:
    """Anything but the right sha256 HMAC is refused, even with a delivery id."""
    headers = Headers({"X-Hub-Signature-256": signature, "X-GitHub-Delivery": "d-1"})
    with pytest.raises(VerificationFailed):
        github(secret=GH_SECRET)(headers, GH_BODY)


# -- Stripe --------------------------------------------------------------------------------


def test_a_stripe_signature_verifies_and_yields_the_event_id() -> None:
    """t= and v1= over "t.body" with the whole secret; the key is the body's id."""
    header = stripe_header(NOW, STRIPE_BODY, STRIPE_SECRET)
    verified = stripe(secret=STRIPE_SECRET, clock=lambda: NOW)(
        Headers({"Stripe-Signature": header + ",v0=ignored"}), STRIPE_BODY
    )
    assert verified.key == "evt_1"


@pytest.mark.parametrize(
    ("offset_s", "accepted"), [(299, True), (-299, True), (301, False), (-301, False)]
)
def test_stripe_tolerates_300_seconds_either_way(offset_s: int, accepted: bool) -> None:
    """Same edges as Standard Webhooks."""
    verify = stripe(secret=STRIPE_SECRET, clock=lambda: NOW + offset_s)
    headers = Headers({"Stripe-Signature": stripe_header(NOW, STRIPE_BODY, STRIPE_SECRET)})
    if accepted:
        assert verify(headers, STRIPE_BODY).key == "evt_1"
    else:
        with pytest.raises(VerificationFailed):
            verify(headers, STRIPE_BODY)


def test_a_stripe_header_with_an_old_and_a_new_signature_is_accepted() -> None:
    """While Stripe rolls a secret it sends two v1= signatures."""
    header = stripe_header(NOW, STRIPE_BODY, "whsec_old", STRIPE_SECRET)
    verify = stripe(secret=STRIPE_SECRET, clock=lambda: NOW)
    assert verify(Headers({"Stripe-Signature": header}), STRIPE_BODY).key == "evt_1"


@pytest.mark.parametrize(
    "header",
    ["", "t=1", f"v1={'0' * 64}", f"t={NOW},t={NOW},v1={'0' * 64}", f"t=x,v1={'0' * 64}"],
)
def test_malformed_stripe_headers_are_unauthenticated(header: str) -> None:
    """No timestamp, two timestamps, no signature: refused."""
    with pytest.raises(VerificationFailed):
        stripe(secret=STRIPE_SECRET, clock=lambda: NOW)(
            Headers({"Stripe-Signature": header}), STRIPE_BODY
        )


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"id": 5}', b'{"type": "x"}', b"[" * 100_000, b'{"a":' * 100_000],
)
def test_a_signed_stripe_body_without_a_string_id_is_a_missing_key(body: bytes) -> None:
    """The signature is right but there is no event id to dedupe on."""
    headers = Headers({"Stripe-Signature": stripe_header(NOW, body, STRIPE_SECRET)})
    verify = stripe(secret=STRIPE_SECRET, clock=lambda: NOW)
    assert verify(headers, body).key is None
    source = App("a").webhook("stripe", verify=verify, channel="c")
    with pytest.raises(KeyMissing, match="'id'"):
        source.identify(headers, body)


# -- API keys ------------------------------------------------------------------------------


def test_an_api_key_maps_to_its_tenant_and_idempotency_key() -> None:
    """Bearer or X-API-Key; the tenant is the mapped name; the key is Idempotency-Key."""
    verify = api_key({"secret-a": "tenant-a", "secret-b": "tenant-b"})
    bearer = Headers({"Authorization": "Bearer secret-b", "Idempotency-Key": "k1"})
    assert (verify(bearer, b"{}").key, verify(bearer, b"{}").tenant) == ("k1", "tenant-b")
    direct = Headers({"X-API-Key": "secret-a", "Idempotency-Key": "k1"})
    assert verify(direct, b"{}").tenant == "tenant-a"


def test_a_list_of_api_keys_scopes_by_a_hash_never_the_key() -> None:
    """Without tenant names the tenant is derived from the key's SHA-256."""
    verify = api_key(["secret-a"])
    tenant = verify(Headers({"X-API-Key": "secret-a", "Idempotency-Key": "k"}), b"").tenant
    assert tenant is not None and tenant.startswith("key-")
    assert "secret" not in tenant
    assert tenant == "key-" + hashlib.sha256(b"secret-a").hexdigest()[:16]


@pytest.mark.parametrize(
    "headers",
    [
        {"Idempotency-Key": "k"},
        {"Authorization": "Bearer wrong", "Idempotency-Key": "k"},
        {"Authorization": "Basic secret-a", "Idempotency-Key": "k"},
        {"Authorization": "Bearer ", "Idempotency-Key": "k"},
    ],
)
def test_a_missing_or_unknown_api_key_is_unauthenticated(headers: dict[str, str]) -> None:
    """Only a configured key authenticates; the challenge names the Bearer scheme."""
    verify = api_key({"secret-a": "tenant-a"})
    with pytest.raises(VerificationFailed):
        verify(Headers(headers), b"")
    assert verify.challenge is not None and verify.challenge.startswith("Bearer")


def test_an_authenticated_request_without_idempotency_key_is_a_missing_key() -> None:
    """Authenticated, but nothing to dedupe on: 400."""
    source = App("a").webhook("api", verify=api_key({"secret-a": "tenant-a"}), channel="c")
    with pytest.raises(KeyMissing, match="Idempotency-Key"):
        source.identify(Headers({"X-API-Key": "secret-a"}), b"")


def test_tenant_names_must_be_safe_scope_parts() -> None:
    """A tenant with '/' would blur scopes: refused by check()."""
    with pytest.raises(ConfigurationError, match="tenant"):
        api_key({"k": "a/b"}).check()


# -- secrets from the environment and registration -----------------------------------------


def test_secrets_from_the_environment_are_read_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """env("NAME") reads at verification time; unset is a configuration error that says so."""
    monkeypatch.delenv("TEST_GH_SECRET", raising=False)
    verify = github(secret=env("TEST_GH_SECRET"))  # nothing read yet
    with pytest.raises(ConfigurationError, match="TEST_GH_SECRET"):
        verify.check()
    monkeypatch.setenv("TEST_GH_SECRET", GH_SECRET)
    headers = Headers({"X-Hub-Signature-256": GH_SIGNATURE, "X-GitHub-Delivery": "d"})
    assert verify(headers, GH_BODY).key == "d"


def test_a_webhook_source_is_registered_with_its_scope_and_scoped_message_id() -> None:
    """Scope is <app>.webhook:<source>[/tenant]; the message id <source>/<tenant>/<key>."""
    app = App("shop")
    source = app.webhook("orders", verify=api_key({"s": "acme"}), channel="orders")
    assert app.webhooks == {"orders": source}
    identity = source.identify(Headers({"X-API-Key": "s", "Idempotency-Key": "k-1"}), b"{}")
    assert identity.scope == "shop.webhook:orders/acme"
    assert identity.message_id == "orders/acme/k-1"
    gh = app.webhook("gh", verify=github(secret=GH_SECRET), channel="github")
    headers = Headers({"X-Hub-Signature-256": GH_SIGNATURE, "X-GitHub-Delivery": "d-1"})
    identity = gh.identify(headers, GH_BODY)
    assert (identity.scope, identity.message_id) == ("shop.webhook:gh", "gh/d-1")


def test_a_key_spec_on_the_source_overrides_the_verifiers_key() -> None:
    """key="body:event.id" takes the key from the verified body."""
    app = App("shop")
    source = app.webhook(
        "orders", verify=api_key({"s": "acme"}), channel="orders", key="body:event.id"
    )
    headers = Headers({"X-API-Key": "s"})
    assert source.identify(headers, b'{"event": {"id": "e-9"}}').key == "e-9"
    with pytest.raises(KeyMissing):
        source.identify(headers, b"not json")


@pytest.mark.parametrize("depth", [1_000, 100_000, 500_000])
def test_json_nested_too_deep_to_read_is_a_missing_key_not_a_crash(depth: int) -> None:
    """A body path on a body deeper than the interpreter's stack finds no key (400)."""
    source = App("shop").webhook(
        "orders", verify=api_key({"s": "acme"}), channel="orders", key="body:id"
    )
    headers = Headers({"X-API-Key": "s"})
    for body in (b"[" * depth, b'{"id":' * depth + b'"k"' + b"}" * depth):
        with pytest.raises(KeyMissing, match="body:id"):
            source.identify(headers, body)


def test_keys_too_long_for_a_message_id_are_refused() -> None:
    """The scoped key must fit an AMQP short string."""
    app = App("shop")
    source = app.webhook("orders", verify=api_key({"s": "acme"}), channel="orders")
    headers = Headers({"X-API-Key": "s", "Idempotency-Key": "k" * 250})
    with pytest.raises(KeyMissing, match="too long"):
        source.identify(headers, b"")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "a/b"}, "name must match"),
        ({"channel": "bad channel"}, "channel"),
        ({"verify": "github"}, "verifier"),
        ({"content_types": ["application/json"]}, "content_types"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
    ],
)
def test_webhook_registration_is_validated(kwargs: dict[str, object], message: str) -> None:
    """Bad names, channels, verifiers and options fail at registration, saying what to do."""
    app = App("shop")
    options: dict[str, object] = {
        "source": "gh",
        "verify": github(secret="s"),
        "channel": "github",
        **kwargs,
    }
    with pytest.raises(ConfigurationError, match=message):
        app.webhook(**options)  # type: ignore[arg-type]


def test_a_source_name_is_declared_once() -> None:
    """Two sources of one name would share a URL and a scope."""
    app = App("shop")
    app.webhook("gh", verify=github(secret="s"), channel="github")
    with pytest.raises(ConfigurationError, match="already declared"):
        app.webhook("gh", verify=github(secret="s"), channel="other")


def test_content_types_accept_json_suffixes_and_refuse_others() -> None:
    """application/json takes application/*+json too; a missing type is refused."""
    source = App("a").webhook("gh", verify=github(secret="s"), channel="c")
    assert source.accepts("application/json; charset=utf-8")
    assert source.accepts("Application/JSON")
    assert source.accepts("application/cloudevents+json")
    assert not source.accepts("text/plain")
    assert not source.accepts(None)
    assert not source.accepts("")


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json; p=" + "x" * 236,  # 256 bytes
        "application/json; " + "x" * 1000,
        "application/json; charset=\xe9",  # latin-1 text of a non-ASCII byte
        "application/json; charset=\u043a",
        "application/json;\x00",
        "application/json\x7f",
    ],
)
def test_a_content_type_no_broker_can_carry_is_refused_even_by_a_catch_all(
    content_type: str,
) -> None:
    """Over 255 bytes (AMQP's content_type is a short string) or not visible ASCII: 415."""
    app = App("a")
    json_only = app.webhook("gh", verify=github(secret="s"), channel="c")
    anything = app.webhook("any", verify=github(secret="s"), channel="c", content_types=("*/*",))
    assert not json_only.accepts(content_type)
    assert not anything.accepts(content_type)
    at_the_limit = "application/json; p=" + "x" * 235  # 255 bytes
    assert json_only.accepts(at_the_limit) and anything.accepts(at_the_limit)
    assert anything.accepts("application/json;\tcharset=utf-8") and anything.accepts(None)


def test_non_ascii_delivery_ids_and_idempotency_keys_are_read_as_utf8() -> None:
    """X-GitHub-Delivery and Idempotency-Key arrive as latin-1 text of their UTF-8 bytes and
    become the text the sender wrote; bytes that are not UTF-8 are kept as they came."""
    key = "ключ_é"
    as_served = key.encode().decode("latin-1")
    gh = Headers({"x-hub-signature-256": GH_SIGNATURE, "x-github-delivery": as_served})
    assert github(secret=GH_SECRET)(gh, GH_BODY).key == key
    verify = api_key({"k-1": "tenant-a"})
    assert verify(Headers({"x-api-key": "k-1", "idempotency-key": as_served}), b"").key == key
    not_utf8 = Headers({"x-api-key": "k-1", "idempotency-key": "caf\xe9"})
    assert verify(not_utf8, b"").key == "caf\xe9"
