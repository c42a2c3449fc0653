"""Handler registration validates everything it can before a message ever arrives."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from dedupe import App, Context, Message
from dedupe.errors import ConfigurationError, InvalidPayload
from dedupe.testing.deliveries import make_message


class Order(BaseModel):
    id: str
    qty: int


def test_a_handler_is_registered_with_its_defaults() -> None:
    """Default key is message_id, scope is app.handler, options are the documented ones."""
    app = App("shop")

    @app.handler("orders")
    async def create(order: Order, ctx: Context) -> None: ...

    handler = app.handlers["create"]
    assert handler.channel == "orders"
    assert handler.key_spec == "message_id"
    assert handler.scope_of(make_message("orders", "{}")) == "shop.create"
    assert (handler.max_attempts, handler.lease_s, handler.retention_s) == (5, 30.0, 7 * 86400)
    assert handler.takes_context
    assert app.channels == {"orders": [handler]}


def test_scope_spec_adds_the_tenant_and_a_missing_tenant_yields_none() -> None:
    """scope='header:X-Tenant-Id' scopes keys per tenant."""
    app = App("shop")

    @app.handler("orders", scope="header:X-Tenant-Id")
    async def create(order: Order) -> None: ...

    handler = app.handlers["create"]
    assert handler.scope_of(make_message("orders", "{}", headers={"x-tenant-id": "t1"})) == (
        "shop.create/t1"
    )
    assert handler.scope_of(make_message("orders", "{}")) is None


def test_sync_functions_are_refused() -> None:
    """Handlers must be async def."""
    app = App("shop")
    with pytest.raises(ConfigurationError, match="async def"):
        app.handler("orders")(lambda order: None)


def test_two_handlers_with_one_name_are_refused() -> None:
    """A duplicate name would share a scope; the error says how to fix it."""
    app = App("shop")

    @app.handler("orders")
    async def create(order: Order) -> None: ...

    with pytest.raises(ConfigurationError, match="name="):

        @app.handler("other")
        async def create(order: Order) -> None: ...


def test_the_first_parameter_must_be_annotated() -> None:
    """Without an annotation the worker cannot decode the body."""
    app = App("shop")
    with pytest.raises(ConfigurationError, match="annotate"):

        @app.handler("orders")
        async def create(order, ctx: Context) -> None: ...  # type: ignore[no-untyped-def]


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 0},
        {"lease_s": -1},
        {"retention_s": 10},  # shorter than the redelivery horizon
        {"timeout_s": 0},
        {"retry_on": (ValueError, "nope")},
        {"key": "bogus"},
    ],
)
def test_invalid_options_are_refused_with_a_message(options: dict[str, object]) -> None:
    """Bad options fail at registration."""
    app = App("shop")
    with pytest.raises(ConfigurationError):

        @app.handler("orders", **options)  # type: ignore[arg-type]
        async def create(order: Order) -> None: ...


def test_decoders_follow_the_annotation() -> None:
    """Models are validated JSON, bytes are raw, Message is the envelope."""
    app = App("shop")

    @app.handler("a")
    async def model(order: Order) -> None: ...

    @app.handler("b")
    async def raw(body: bytes) -> None: ...

    @app.handler("c")
    async def envelope(message: Message) -> None: ...

    m = make_message("a", '{"id": "1", "qty": 2}')
    assert app.handlers["model"].decode(m) == Order(id="1", qty=2)
    assert app.handlers["raw"].decode(m) == m.body
    assert app.handlers["envelope"].decode(m) is m
    with pytest.raises(InvalidPayload, match="not valid JSON"):
        app.handlers["model"].decode(make_message("a", "{oops"))
    with pytest.raises(InvalidPayload, match="qty"):
        app.handlers["model"].decode(make_message("a", '{"id": "1", "qty": "many"}'))


def test_app_names_are_checked() -> None:
    """The app name prefixes scopes, so it must be a plain identifier."""
    with pytest.raises(ConfigurationError):
        App("my app!")


def test_handlers_and_webhook_sources_take_a_fingerprint_and_keep_payload() -> None:
    """fingerprint=, fingerprint_exclude= and keep_payload= (defaults: raw, none, False)."""
    from dedupe.claims.fingerprints import RAW
    from dedupe.webhooks import api_key

    app = App("shop")

    @app.handler("orders", fingerprint="json", fingerprint_exclude=("sent_at",), keep_payload=True)
    async def create(order: Order) -> None: ...

    @app.handler("orders")
    async def audit(order: Order) -> None: ...

    assert app.handlers["create"].fingerprint.stored == 'json exclude=["sent_at"]'
    assert app.handlers["create"].keep_payload is True
    assert (app.handlers["audit"].fingerprint, app.handlers["audit"].keep_payload) == (RAW, False)
    source = app.webhook(
        "orders-api",
        verify=api_key({"k": "tenant-a"}),
        key="header:Idempotency-Key",
        channel="orders",
        fingerprint="json",
        keep_payload=True,
    )
    assert (source.fingerprint.stored, source.keep_payload) == ("json", True)
    plain = app.webhook("plain", verify=api_key({"k": "t"}), channel="orders")
    assert (plain.fingerprint, plain.keep_payload) == (RAW, False)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"fingerprint": "xml"}, r"handler 'create': fingerprint='xml': use 'raw'"),
        ({"fingerprint_exclude": ("sent_at",)}, "needs fingerprint='json'"),
        ({"fingerprint": "json", "fingerprint_exclude": ("a..b",)}, "empty segment"),
        ({"keep_payload": "yes"}, "keep_payload must be True or False"),
    ],
)
def test_a_bad_fingerprint_option_is_refused_at_registration(
    options: dict[str, object], match: str
) -> None:
    """On a handler and on a webhook source alike, naming which one."""
    from dedupe.webhooks import api_key

    app = App("shop")
    with pytest.raises(ConfigurationError, match=match):

        @app.handler("orders", **options)  # type: ignore[arg-type]
        async def create(order: Order) -> None: ...

    with pytest.raises(ConfigurationError, match=match.replace("handler 'create'", "'hook'")):
        app.webhook("hook", verify=api_key({"k": "t"}), channel="orders", **options)  # type: ignore[arg-type]
