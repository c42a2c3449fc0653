"""What the receiver refuses before it claims a key: a Content-Type, a Content-Length, headers
or a body that no broker would carry, and JSON nested too deep to read. Each is the client's
4xx, never a 503 that the sender's every retry would meet again."""

from __future__ import annotations

import json

import asyncpg
import httpx
import pytest

import dedupe_rabbitmq as rabbitmq
from dedupe import App
from dedupe.claims.store import ClaimStore
from dedupe.errors import ConfigurationError
from dedupe.message import Headers, Message
from dedupe.webhooks import api_key, env, github
from dedupe_kafka.publisher import KafkaPublisher
from dedupe_receiver.application import create_receiver
from dedupe_receiver.forwarding import (
    MAX_FORWARDED_HEADER_BYTES,
    forwarded_headers,
    header_list_bytes,
)
from dedupe_receiver.limits import body_limit
from tests.integration.test_receiver import (  # noqa: F401 - fixtures
    API_KEY_A,
    CountingPublisher,
    assert_problem,
    client,
    github_request,
    hooks,
    keyed_client,
    publisher,
    secrets,
    stripe_request,
)


async def claims(db: asyncpg.Connection) -> int:
    return int(await db.fetchval("SELECT count(*) FROM dedupe_claims"))


# -- Content-Type and Content-Length ---------------------------------------------------------


@pytest.mark.parametrize(
    "content_types",
    [
        [b"application/json; p=" + b"x" * 300],
        [b"application/json; charset=\xe9"],
        # Sent twice: the last one is forwarded, so the last one is checked.
        [b"application/json", b"application/json; p=" + b"x" * 300],
    ],
    ids=["over-255-bytes", "not-ascii", "the-second-of-two"],
)
async def test_a_content_type_the_broker_cannot_carry_is_a_415_not_a_503(
    client: httpx.AsyncClient,  # noqa: F811
    publisher: CountingPublisher,  # noqa: F811
    db: asyncpg.Connection,
    content_types: list[bytes],
) -> None:
    """AMQP's content_type holds 255 bytes: a longer one would fail every publish (503 on
    every retry), so it is refused up front, and nothing is claimed or published."""
    body = b'{"ref":"main"}'
    signed = [(k.encode(), v.encode()) for k, v in github_request(body, "d-ct").items()]
    raw = [(k, v) for k, v in signed if k != b"Content-Type"]
    raw += [(b"content-type", value) for value in content_types]
    response = await client.post("/webhooks/github", content=body, headers=raw)
    assert_problem(response, 415, "unsupported-media-type")
    assert publisher.published == []
    assert await claims(db) == 0


@pytest.mark.parametrize(
    "declared",
    [b"\xb2", "\u0663".encode(), b"1" * 5000, b"-1", b"+1", b" 1", b"1 ", b"0x10", b"1_0", b""],
    ids=["superscript-two", "arabic-three", "5000-digits", "minus", "plus", "lead", "trail",
         "hex", "underscore", "empty"],
)  # fmt: skip
async def test_a_content_length_that_is_not_plain_digits_is_a_400(
    client: httpx.AsyncClient,  # noqa: F811
    db: asyncpg.Connection,
    declared: bytes,
) -> None:
    """str.isdigit() takes "²", and int() refuses over 4300 digits: neither may be a 500."""
    body = b'{"ref":"main"}'
    raw = [(k.encode(), v.encode()) for k, v in github_request(body, "d-cl").items()]
    request = client.build_request(
        "POST", "/webhooks/github", content=body, headers=[*raw, (b"content-length", declared)]
    )
    response = await client.send(request)
    assert_problem(response, 400, "bad-request")
    assert await claims(db) == 0


# -- JSON nested too deep ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [5_000, 100_000])
async def test_json_nested_deeper_than_the_stack_is_a_400_on_key_and_stripe_sources(
    keyed_client: httpx.AsyncClient,  # noqa: F811
    publisher: CountingPublisher,  # noqa: F811
    depth: int,
) -> None:
    """A RecursionError while looking for the key is "no key here" (400), not a 500."""
    auth = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY_A}"}
    for body in (b"[" * depth + b"]" * depth, b'{"id":' * depth + b'"k"' + b"}" * depth):
        response = await keyed_client.post("/webhooks/ledger", content=body, headers=auth)
        assert_problem(response, 400, "missing-key")
        signed = await keyed_client.post(
            "/webhooks/stripe", content=body, headers=stripe_request(body)
        )
        assert_problem(signed, 400, "missing-key")
    assert publisher.published == []


# -- headers and bodies over what the broker takes --------------------------------------------


async def test_headers_over_the_forwarding_limit_are_a_431(
    client: httpx.AsyncClient,  # noqa: F811
    publisher: CountingPublisher,  # noqa: F811
    db: asyncpg.Connection,
) -> None:
    """Forwarded headers are bounded (32 KiB counted as HTTP/2 does): past it, 431."""
    body = b'{"ref":"main"}'
    headers = {**github_request(body, "d-h"), "X-Padding": "p" * MAX_FORWARDED_HEADER_BYTES}
    response = await client.post("/webhooks/github", content=body, headers=headers)
    assert_problem(response, 431, "headers-too-large")
    assert publisher.published == []
    assert await claims(db) == 0


@pytest.fixture
async def kafka_app(secrets: None, channel: str) -> App:  # noqa: F811
    app = App("limits")
    app.webhook("github", verify=github(secret=env("GITHUB_WEBHOOK_SECRET")), channel=channel)
    return app


async def test_a_body_near_a_mebibyte_on_kafka_is_a_413_and_the_largest_accepted_one_fits(
    kafka_app: App, store: ClaimStore, db: asyncpg.Connection, kafka_url: str
) -> None:
    """Kafka's producer takes 1 MiB per request, headers and key included, and so did
    max_body_bytes: a body just under 1 MiB failed every publish with a 503. The receiver
    now takes bodies up to the producer's limit less room for headers: just over is a 413
    before anything is claimed, and the largest body with the largest headers is accepted."""
    kafka = KafkaPublisher(kafka_url)
    try:
        receiver = create_receiver(kafka_app, store=store, publisher=kafka)
        source = kafka_app.webhooks["github"]
        limit = body_limit(source, receiver.state.receiver.message_limit)
        assert 1_000_000 < limit < source.max_body_bytes
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as http:
            near = json.dumps({"pad": "x" * (1024 * 1024 - 100)}).encode()
            refused = await http.post(
                "/webhooks/github", content=near, headers=github_request(near, "d-near")
            )
            assert_problem(refused, 413, "payload-too-large")
            assert str(limit) in refused.json()["detail"]
            assert await claims(db) == 0

            largest = json.dumps({"pad": "x" * (limit - 11)}).encode()
            assert len(largest) == limit
            request = http.build_request(
                "POST", "/webhooks/github", content=largest, headers=github_request(largest, "d-1")
            )
            identity = source.identify(Headers(request.headers), largest)
            room = MAX_FORWARDED_HEADER_BYTES - header_list_bytes(
                forwarded_headers(Headers(request.headers), source, identity)
            )
            request.headers["x-padding"] = "p" * (room - len("x-padding") - 32)
            accepted = await http.send(request)
            assert accepted.status_code == 202, accepted.text
    finally:
        await kafka.close()


class OverconfidentKafkaPublisher(KafkaPublisher):
    """Claims a larger message limit than its producer has (as when the broker's own limit
    is below the client's): the producer refuses the message itself."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.max_message_bytes = 4 * 1024 * 1024


async def test_max_request_size_in_the_kafka_url_raises_the_receivers_body_limit(
    kafka_app: App, store: ClaimStore, kafka_url: str
) -> None:
    """?max_request_size= sets the producer's limit, and the receiver fits bodies under it."""
    source = kafka_app.webhooks["github"]
    for size, expected in ((1_048_576, None), (4 * 1_048_576, source.max_body_bytes)):
        kafka = KafkaPublisher(f"{kafka_url}?max_request_size={size}")
        try:
            receiver = create_receiver(kafka_app, store=store, publisher=kafka)
            limit = body_limit(source, receiver.state.receiver.message_limit)
            if expected is None:
                assert limit < source.max_body_bytes  # lowered to fit 1 MiB requests
            else:
                assert limit == expected  # 4 MiB requests: the source's own limit holds
        finally:
            await kafka.close()


async def test_a_message_the_broker_refuses_for_its_size_is_a_413_and_its_key_is_released(
    secrets: None,  # noqa: F811
    channel: str,
    store: ClaimStore,
    db: asyncpg.Connection,
    kafka_url: str,
) -> None:
    """MessageSizeTooLargeError is the request's fault: 413 (not a 503 for every retry), and
    the claim is given back at once."""
    app = App("limits")
    app.webhook(
        "github",
        verify=github(secret=env("GITHUB_WEBHOOK_SECRET")),
        channel=channel,
        max_body_bytes=2 * 1024 * 1024,
    )
    kafka = OverconfidentKafkaPublisher(kafka_url)
    try:
        receiver = create_receiver(app, store=store, publisher=kafka)
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as http:
            body = json.dumps({"pad": "x" * 1_500_000}).encode()
            response = await http.post(
                "/webhooks/github", content=body, headers=github_request(body, "d-big")
            )
            assert_problem(response, 413, "payload-too-large")
        row = await db.fetchrow(
            "SELECT status, lease_until <= now() AS released FROM dedupe_claims"
        )
        assert (row["status"], row["released"]) == ("in_progress", True)
        assert receiver.state.receiver.stats["broker_refused"] == 1
    finally:
        await kafka.close()


async def test_a_broker_limit_that_leaves_no_room_for_a_body_stops_the_receiver_at_once(
    hooks: App,  # noqa: F811
    store: ClaimStore,
) -> None:
    """A publisher whose messages cannot hold a reasonable body is a configuration error."""

    class Tiny:
        max_message_bytes = 40_000

        async def publish(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("never called")

        async def close(self) -> None:
            pass

    with pytest.raises(ConfigurationError, match="max_request_size"):
        create_receiver(hooks, store=store, publisher=Tiny())


# -- a key function that raises ----------------------------------------------------------------


async def test_a_key_function_that_raises_is_a_400_and_nothing_is_claimed_or_published(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    db: asyncpg.Connection,
    amqp_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A user's key callable that cannot read a verified request (here a KeyError on a body
    without its field) refuses the request with a 400, never a 500; its message stays in the
    log, the client sees only the exception's class."""

    def order_id(message: Message) -> str:
        return str(json.loads(message.body)["order"]["id"])

    source = hooks.webhook(
        "by-order",
        verify=api_key({API_KEY_A: "tenant-a"}),
        channel=f"{hooks.webhooks['orders'].channel}-by-order",
        key=order_id,
    )
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    transport = httpx.ASGITransport(app=receiver)
    async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as http:
        response = await http.post(
            "/webhooks/by-order",
            content=b'{"secret-looking": "value"}',
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY_A}"},
        )
        document = assert_problem(response, 400, "missing-key")
        assert "KeyError" in str(document["detail"])
        assert "order" not in str(document["detail"])
        ok = await http.post(
            "/webhooks/by-order",
            content=b'{"order": {"id": 7}}',
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY_A}"},
        )
        assert ok.status_code == 202, ok.text
    assert await claims(db) == 1  # the readable request only
    assert len(publisher.published) == 1
    assert any("key function raised" in r.getMessage() for r in caplog.records)
    await rabbitmq.delete_channels(amqp_url, [source.channel])  # no handler: not in app.channels
