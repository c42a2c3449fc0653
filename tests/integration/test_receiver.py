"""The webhook receiver against real PostgreSQL and RabbitMQ: replay, conflicts, outages,
concurrency, fuzzing, the whole path to a worker, and the `dedupe-worker receive` command."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Mount

import dedupe_rabbitmq as rabbitmq
from dedupe import App
from dedupe.claims.records import ClaimRequest
from dedupe.claims.store import ClaimStore
from dedupe.webhooks import api_key, env, github
from dedupe_kafka.publisher import KafkaPublisher
from dedupe_kafka.transport import KafkaTransport
from dedupe_rabbitmq.publisher import RabbitMQPublisher
from dedupe_rabbitmq.transport import RabbitMQTransport
from dedupe_receiver.application import create_receiver
from dedupe_receiver.limits import DISCARD_BYTES
from handlers.webhooks import make_app, setup
from tests.conftest import (
    CHECKOUT_PATH,
    KAFKA_URL,
    ROOT,
    delete_channel_everywhere,
    eventually,
    running,
)

GH_SECRET = "gh-secret-7f3a9c1e"
STRIPE_SECRET = "whsec_stripe-secret-5b2d8e"
BILLING_SECRET = "whsec_" + base64.b64encode(b"billing-secret-0c4f6a").decode()
API_KEY_A = "api-key-a-91e2d7"
API_KEY_B = "api-key-b-3c8f05"
SECRETS = (GH_SECRET, STRIPE_SECRET, BILLING_SECRET, API_KEY_A, API_KEY_B, "billing-secret")


# -- signing, as the providers do it ----------------------------------------------------------


def github_request(body: bytes, delivery: str, *, secret: str = GH_SECRET) -> dict[str, str]:
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "Content-Type": "application/json",
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": delivery,
        "X-Hub-Signature-256": f"sha256={signature}",
    }


def stripe_request(body: bytes, *, at: float | None = None) -> dict[str, str]:
    t = int(time.time() if at is None else at)
    signature = hmac.new(STRIPE_SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256)
    return {
        "Content-Type": "application/json",
        "Stripe-Signature": f"t={t},v1={signature.hexdigest()}",
    }


def billing_request(body: bytes, msg_id: str, *, at: float | None = None) -> dict[str, str]:
    t = int(time.time() if at is None else at)
    key = base64.b64decode(BILLING_SECRET.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{t}.".encode() + body, hashlib.sha256).digest()
    return {
        "Content-Type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(t),
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }


def orders_request(key: str, *, api_key: str = API_KEY_A) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {api_key}",
        "Idempotency-Key": key,
    }


# -- fixtures --------------------------------------------------------------------------------


@dataclass
class CountingPublisher:
    """The real publisher, counting what reached the broker; can fail the next N publishes."""

    inner: RabbitMQPublisher
    published: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    fail_next: int = 0
    delay_s: float = 0.0

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        await asyncio.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("broker unreachable (simulated)")
        await self.inner.publish(channel, body, message_id=message_id, headers=headers)
        self.published.append((channel, message_id, dict(headers)))

    async def ready(self) -> bool:
        return await self.inner.ready()

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_WEBHOOK_SECRET", GH_SECRET)
    monkeypatch.setenv("STRIPE_WEBHOOK_SECRET", STRIPE_SECRET)
    monkeypatch.setenv("BILLING_WEBHOOK_SECRET", BILLING_SECRET)
    monkeypatch.setenv("ORDERS_API_KEYS", f"{API_KEY_A}=tenant-a,{API_KEY_B}=tenant-b")


@pytest.fixture
async def hooks(secrets: None, channel: str, request: pytest.FixtureRequest) -> AsyncIterator[App]:
    """The example app on channels of this test's own; their queues (and a Kafka test's
    topics) go at the end."""
    app = make_app(prefix=f"{channel}-")
    yield app
    await delete_channel_everywhere(request, *app.channels)


@pytest.fixture
async def publisher(amqp_url: str) -> AsyncIterator[CountingPublisher]:
    counting = CountingPublisher(RabbitMQPublisher(amqp_url))
    yield counting
    await counting.close()


@pytest.fixture
async def client(
    hooks: App, store: ClaimStore, publisher: CountingPublisher
) -> AsyncIterator[httpx.AsyncClient]:
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    transport = httpx.ASGITransport(app=receiver)
    async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as http:
        yield http


async def queue_depth(url: str, name: str) -> int:
    connection = await aio_pika.connect(url)
    async with connection:
        amqp = await connection.channel()
        queue = await amqp.declare_queue(name, passive=True)
        return int(queue.declaration_result.message_count or 0)


def assert_problem(response: httpx.Response, status: int, slug: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    document = response.json()
    assert document["status"] == status
    assert document["type"] == f"urn:dedupe-worker:problem:{slug}"
    assert document["title"]
    return dict(document)


# -- the contract ----------------------------------------------------------------------------


async def test_a_github_delivery_is_published_once_and_replayed_byte_for_byte(
    client: httpx.AsyncClient, publisher: CountingPublisher, hooks: App, amqp_url: str
) -> None:
    """202 once; the same delivery again gets the same status and body, flagged as a replay."""
    body = json.dumps({"ref": "refs/heads/main", "after": "abc"}).encode()
    headers = github_request(body, "d-1")
    first = await client.post("/webhooks/github", content=body, headers=headers)
    assert first.status_code == 202, first.text
    assert "idempotent-replayed" not in first.headers
    assert first.json() == {
        "status": "accepted",
        "source": "github",
        "key": "d-1",
        "message_id": "github/d-1",
    }
    again = await client.post("/webhooks/github", content=body, headers=headers)
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"] == first.headers["content-type"]

    channel = hooks.webhooks["github"].channel
    assert [(c, m) for c, m, _ in publisher.published] == [(channel, "github/d-1")]
    assert await queue_depth(amqp_url, channel) == 1
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        amqp = await connection.channel()
        queue = await amqp.declare_queue(channel, passive=True)
        message = await queue.get(timeout=5)
        assert message is not None
        await message.nack(requeue=True)
    assert message.message_id == "github/d-1"
    assert message.body == body
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    forwarded = dict(message.headers or {})
    assert forwarded["x-github-event"] == "push"
    assert forwarded["x-dedupe-webhook-source"] == "github"
    assert "x-hub-signature-256" not in forwarded


async def test_the_same_key_with_another_body_is_a_422_and_publishes_nothing(
    client: httpx.AsyncClient, publisher: CountingPublisher
) -> None:
    """A key is bound to the body it was first used with."""
    first = await client.post("/webhooks/orders", content=b'{"n":1}', headers=orders_request("k"))
    assert first.status_code == 202
    other = await client.post("/webhooks/orders", content=b'{"n":2}', headers=orders_request("k"))
    assert_problem(other, 422, "key-conflict")
    assert len(publisher.published) == 1


async def test_a_key_in_flight_is_a_409_with_retry_after(
    client: httpx.AsyncClient, store: ClaimStore, publisher: CountingPublisher
) -> None:
    """Another request holds the key right now: come back shortly, nothing is published."""
    body = b'{"n":1}'
    [claim] = await store.claim_batch(
        [ClaimRequest("hooks.webhook:orders/tenant-a", "k", hashlib.sha256(body).digest())],
        lease_s=30,
        retention_s=3600,
    )
    assert claim.owned
    response = await client.post("/webhooks/orders", content=body, headers=orders_request("k"))
    assert_problem(response, 409, "in-flight")
    assert int(response.headers["retry-after"]) >= 1
    assert publisher.published == []


async def test_every_client_error_is_a_4xx_problem(
    client: httpx.AsyncClient, publisher: CountingPublisher
) -> None:
    """Missing key 400, bad or stale signature 401, unknown source 404, wrong method 405,
    too large 413, wrong type 415: all problem+json, none published."""
    body = b'{"ref":"x"}'
    no_key = github_request(body, "d")
    del no_key["X-GitHub-Delivery"]
    assert_problem(
        await client.post("/webhooks/github", content=body, headers=no_key), 400, "missing-key"
    )
    no_idem = orders_request("k")
    del no_idem["Idempotency-Key"]
    assert_problem(
        await client.post("/webhooks/orders", content=body, headers=no_idem), 400, "missing-key"
    )

    forged = github_request(body, "d", secret="not-the-secret")
    assert_problem(
        await client.post("/webhooks/github", content=body, headers=forged), 401, "unauthenticated"
    )
    stale = billing_request(body, "msg-1", at=time.time() - 310)
    assert_problem(
        await client.post("/webhooks/billing", content=body, headers=stale), 401, "unauthenticated"
    )
    future = stripe_request(b'{"id":"evt"}', at=time.time() + 310)
    assert_problem(
        await client.post("/webhooks/stripe", content=b'{"id":"evt"}', headers=future),
        401,
        "unauthenticated",
    )
    wrong_key = await client.post(
        "/webhooks/orders", content=body, headers=orders_request("k", api_key="nope")
    )
    assert_problem(wrong_key, 401, "unauthenticated")
    assert wrong_key.headers["www-authenticate"].startswith("Bearer")

    assert_problem(
        await client.post("/webhooks/gitlab", content=body, headers=no_key), 404, "unknown-source"
    )
    assert_problem(await client.get("/webhooks/github"), 405, "http-error")
    assert_problem(await client.get("/nowhere"), 404, "http-error")
    text = {**github_request(body, "d"), "Content-Type": "text/plain"}
    assert_problem(
        await client.post("/webhooks/github", content=body, headers=text),
        415,
        "unsupported-media-type",
    )
    none = github_request(body, "d")
    del none["Content-Type"]
    assert_problem(
        await client.post("/webhooks/github", content=body, headers=none),
        415,
        "unsupported-media-type",
    )
    huge = b"x" * (1024 * 1024 + 1)
    assert_problem(
        await client.post("/webhooks/github", content=huge, headers=github_request(huge, "d")),
        413,
        "payload-too-large",
    )
    assert publisher.published == []


async def test_a_body_over_the_limit_is_refused_before_it_is_all_read(
    client: httpx.AsyncClient,
) -> None:
    """Without Content-Length the body is counted as it streams in, kept up to 1 MiB, and
    read no further than DISCARD_BYTES past it (dropped, so the client reads its 413)."""
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1600):  # 100 MiB if it were all read
            sent += 65536
            yield b"x" * 65536

    headers = github_request(b"", "d")
    response = await client.post("/webhooks/github", content=endless(), headers=headers)
    assert_problem(response, 413, "payload-too-large")
    assert response.headers["connection"] == "close"
    assert sent <= 1024 * 1024 + DISCARD_BYTES + 2 * 65536


async def test_a_broker_outage_is_a_503_and_the_senders_retry_succeeds_at_once(
    client: httpx.AsyncClient, publisher: CountingPublisher, db: asyncpg.Connection
) -> None:
    """The claim is given back on a failed publish, so the retry does not wait for a lease."""
    body = json.dumps({"id": "evt_outage", "type": "charge.succeeded"}).encode()
    publisher.fail_next = 1
    failed = await client.post("/webhooks/stripe", content=body, headers=stripe_request(body))
    assert_problem(failed, 503, "broker-unavailable")
    assert int(failed.headers["retry-after"]) > 0
    row = await db.fetchrow(
        "SELECT status, lease_until <= now() AS released, token FROM dedupe_claims"
    )
    assert (row["status"], row["released"]) == ("in_progress", True)
    first_token = row["token"]

    retried = await client.post("/webhooks/stripe", content=body, headers=stripe_request(body))
    assert retried.status_code == 202
    assert "idempotent-replayed" not in retried.headers
    assert [m for _, m, _ in publisher.published] == ["stripe/evt_outage"]
    row = await db.fetchrow("SELECT status, token FROM dedupe_claims")
    assert row["status"] == "completed"
    assert row["token"] > first_token  # the retry took the key over


async def test_an_unreachable_broker_gives_503_and_an_unready_readyz(
    hooks: App, store: ClaimStore
) -> None:
    """A real publisher pointed at a closed port: 503 (never 500) and /readyz says why."""
    dead = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:1/", timeout_s=2)
    receiver = create_receiver(hooks, store=store, publisher=dead)
    transport = httpx.ASGITransport(app=receiver)
    async with httpx.AsyncClient(transport=transport, base_url="http://r") as http:
        body = b'{"n":1}'
        response = await http.post("/webhooks/orders", content=body, headers=orders_request("k"))
        assert_problem(response, 503, "broker-unavailable")
        ready = await http.get("/readyz")
        assert_problem(ready, 503, "not-ready")
        assert ready.json()["checks"] == {"postgresql": "ok", "broker": "unavailable"}
        assert (await http.get("/healthz")).status_code == 200
    await dead.close()


async def test_a_postgresql_outage_is_a_503_never_a_500(
    hooks: App, db_url: str, publisher: CountingPublisher
) -> None:
    """The claim store going away is an outage of ours: 503 + Retry-After, nothing published."""
    async with ClaimStore.open(db_url, owner="doomed") as doomed:
        receiver = create_receiver(hooks, store=doomed, publisher=publisher)
    # The pool is closed now, as after losing the database.
    transport = httpx.ASGITransport(app=receiver)
    async with httpx.AsyncClient(transport=transport, base_url="http://r") as http:
        body = b'{"n":1}'
        response = await http.post("/webhooks/orders", content=body, headers=orders_request("k"))
        assert_problem(response, 503, "store-unavailable")
        assert response.headers["retry-after"]
        ready = await http.get("/readyz")
        assert_problem(ready, 503, "not-ready")
        assert ready.json()["checks"]["postgresql"] == "unavailable"
    assert publisher.published == []


async def test_readyz_checks_postgresql_and_the_broker(client: httpx.AsyncClient) -> None:
    """Both reachable: 200 with each check named."""
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "checks": {"postgresql": "ok", "broker": "ok"}}


async def test_twenty_simultaneous_identical_requests_publish_once(
    client: httpx.AsyncClient, publisher: CountingPublisher, hooks: App, amqp_url: str
) -> None:
    """One request wins the claim; the others see it in flight (409) or replay its 202."""
    publisher.delay_s = 0.05  # hold the key a moment so the others arrive while it is held
    body = json.dumps({"type": "invoice.paid", "amount": 100}).encode()
    headers = billing_request(body, "msg-concurrent")
    responses = await asyncio.gather(
        *(client.post("/webhooks/billing", content=body, headers=headers) for _ in range(20))
    )
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {202, 409}, statuses
    fresh = [
        r for r in responses if r.status_code == 202 and "idempotent-replayed" not in r.headers
    ]
    assert len(fresh) == 1
    assert len(publisher.published) == 1
    assert await queue_depth(amqp_url, hooks.webhooks["billing"].channel) == 1
    late = await client.post("/webhooks/billing", content=body, headers=headers)
    assert (late.status_code, late.content) == (202, fresh[0].content)


async def test_concurrent_new_keys_store_their_replies_in_shared_statements(
    hooks: App, store: ClaimStore, publisher: CountingPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty keys published at the same moment: their replies are stored in fewer statements
    than requests (each statement carries what queued while the one before ran), and each key
    replays its own reply, byte for byte."""
    statements: list[int] = []
    complete = store.complete_unlocked

    async def counted(outcomes: Sequence[Any], **kwargs: Any) -> Any:
        statements.append(len(outcomes))
        return await complete(outcomes, **kwargs)

    monkeypatch.setattr(store, "complete_unlocked", counted)
    publisher.delay_s = 0.05  # the publishes end together, so their replies queue together
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    transport = httpx.ASGITransport(app=receiver)
    bodies = {f"msg-shared-{i}": json.dumps({"n": i}).encode() for i in range(40)}
    async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as http:
        first = await asyncio.gather(
            *(
                http.post("/webhooks/billing", content=body, headers=billing_request(body, key))
                for key, body in bodies.items()
            )
        )
        assert [r.status_code for r in first] == [202] * 40, [r.text for r in first]
        assert not any("idempotent-replayed" in r.headers for r in first)
        assert sum(statements) == 40, statements
        assert len(statements) < 40, f"one reply statement per request: {statements}"
        again = [
            await http.post("/webhooks/billing", content=body, headers=billing_request(body, key))
            for key, body in bodies.items()
        ]
    assert [(r.status_code, r.headers.get("idempotent-replayed")) for r in again] == [
        (202, "true")
    ] * 40
    assert [r.content for r in again] == [r.content for r in first]
    assert len(publisher.published) == 40


async def test_a_taken_over_reply_sharing_a_statement_with_the_new_owners_is_not_completed(
    store: ClaimStore, publisher: CountingPublisher, db: asyncpg.Connection
) -> None:
    """A request whose lease lapsed and the request that took its key over store their
    replies in the same statement: only the new owner's completes, and the stale one is told
    so (its "taken over" line), not that its reply was stored."""
    from dedupe.claims.records import Fence
    from dedupe.observability.metrics import Metrics
    from dedupe_receiver.intake import Intake

    intake = Intake(
        store=store,
        publisher=publisher,
        activity=None,
        stats=collections.Counter(),
        metrics=Metrics(),
        publish_timeout_s=1.0,
        store_timeout_s=3.0,
    )
    [lapsed] = await store.claim_batch([ClaimRequest("s", "k", b"h")], lease_s=0.2, retention_s=60)
    await asyncio.sleep(0.4)
    [owner] = await store.claim_batch([ClaimRequest("s", "k", b"h")], lease_s=30, retention_s=60)
    assert owner.owned and owner.token != lapsed.token
    stale, fresh = Fence("s", "k", lapsed.token or 0), Fence("s", "k", owner.token or 0)
    results = await asyncio.gather(  # submitted in one tick: one statement carries both
        intake.replies.submit([(stale, '{"stale": 1}', 60.0)]),
        intake.replies.submit([(fresh, '{"fresh": 1}', 60.0)]),
    )
    assert results == [[False], [True]]
    assert json.loads(await db.fetchval("SELECT result FROM dedupe_claims")) == {"fresh": 1}


async def test_a_standard_webhook_with_a_non_ascii_id_is_accepted_under_that_id(
    client: httpx.AsyncClient, publisher: CountingPublisher
) -> None:
    """A webhook-id the sender wrote in UTF-8 verifies and is accepted (202) with that key,
    not refused as control characters; the same id again is a replay."""
    body = b'{"invoice":"in-1"}'
    msg_id = "msg_ключ_é"
    headers: dict[str, str | bytes] = dict(billing_request(body, msg_id))
    headers["webhook-id"] = msg_id.encode()  # on the wire as UTF-8 bytes
    first = await client.post("/webhooks/billing", content=body, headers=headers)
    assert first.status_code == 202, first.text
    assert first.json()["key"] == msg_id
    again = await client.post("/webhooks/billing", content=body, headers=headers)
    assert (again.status_code, again.headers["idempotent-replayed"]) == (202, "true")
    assert [m for _, m, _ in publisher.published] == [f"billing/{msg_id}"]


async def test_api_keys_scope_idempotency_keys_per_tenant(
    client: httpx.AsyncClient, publisher: CountingPublisher, db: asyncpg.Connection
) -> None:
    """Two tenants sending the same Idempotency-Key never collide, here or downstream."""
    body = b'{"sku":"a"}'
    a = await client.post("/webhooks/orders", content=body, headers=orders_request("o-1"))
    b = await client.post(
        "/webhooks/orders", content=body, headers=orders_request("o-1", api_key=API_KEY_B)
    )
    assert (a.status_code, b.status_code) == (202, 202)
    assert "idempotent-replayed" not in b.headers
    assert [m for _, m, _ in publisher.published] == ["orders/tenant-a/o-1", "orders/tenant-b/o-1"]
    scopes = sorted(r["scope"] for r in await db.fetch("SELECT scope FROM dedupe_claims"))
    assert scopes == ["hooks.webhook:orders/tenant-a", "hooks.webhook:orders/tenant-b"]
    forwarded = publisher.published[0][2]
    assert forwarded["x-dedupe-webhook-tenant"] == "tenant-a"
    assert "authorization" not in forwarded


# -- fuzzing -----------------------------------------------------------------------------------


@pytest.fixture
async def keyed_client(
    hooks: App, store: ClaimStore, publisher: CountingPublisher, amqp_url: str
) -> AsyncIterator[httpx.AsyncClient]:
    """The example app plus "ledger", whose key is the body's "id" (API-key auth)."""
    ledger = hooks.webhook(
        "ledger",
        verify=api_key({API_KEY_A: "tenant-a"}),
        channel=f"{hooks.webhooks['orders'].channel}-ledger",
        key="body:id",
    )
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    transport = httpx.ASGITransport(app=receiver)
    async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as http:
        yield http
    await rabbitmq.delete_channels(amqp_url, [ledger.channel])  # no handler: not in app.channels


HEADER_NAMES = [
    "content-type",
    "content-length",
    "x-hub-signature-256",
    "x-github-delivery",
    "stripe-signature",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "authorization",
    "x-api-key",
    "idempotency-key",
    "x-dedupe-deferrals",
    "message-id",
    "transfer-encoding",
]


def _no_line_breaks(value: bytes) -> bytes:
    return value.replace(b"\r", b"").replace(b"\n", b"")


def _repeated(pattern: bytes, size: int) -> bytes:
    return (pattern * (size // len(pattern) + 1))[:size]


# Header values past AMQP's 255-byte short strings, up to a few KiB (a drawn pattern,
# repeated: drawing thousands of bytes one by one would dominate the run time).
long_header_values = st.builds(
    _repeated,
    st.binary(min_size=1, max_size=16).map(_no_line_breaks).filter(bool),
    st.integers(200, 4000),
)
# Content-Types around the 255 bytes of AMQP's content_type, and with a non-ASCII byte.
long_content_types = st.integers(200, 400).map(lambda n: b"application/json; p=" + b"x" * (n - 20))
header_values = st.one_of(
    st.binary(max_size=80).map(_no_line_breaks),
    long_header_values,
    st.sampled_from(
        [
            b"application/json",
            b"application/json; charset=utf-8",
            b"application/json; charset=\xe9",
            b"sha256=" + b"0" * 64,
            b"t=1,v1=" + b"a" * 64,
            b"v1,AAAA",
            b"Bearer " + API_KEY_A.encode(),
            API_KEY_B.encode(),
            str(int(time.time())).encode(),
            b"-1",
            b"99999999999999999999",
            b"",
        ]
    ),
)
fuzz_headers = st.lists(
    st.tuples(
        st.one_of(
            st.sampled_from(HEADER_NAMES),
            st.from_regex(r"\Ax-[a-z0-9-]{1,20}\Z"),
            st.integers(120, 300).map(lambda n: "x-long-" + "n" * n),  # past AMQP's 128-byte keys
        ).map(str.encode),
        header_values,
    ),
    max_size=10,
)
# Content-Length values a strict parser must refuse: str.isdigit() takes "²" (sent as the
# latin-1 byte it is on the wire), int() refuses more than 4300 digits.
odd_content_lengths = st.one_of(
    st.text(alphabet="0123456789²³¹ +-_", max_size=6).map(lambda s: s.encode("latin-1")),
    st.integers(4301, 6000).map(lambda n: b"1" * n),
    st.from_regex(rb"\A[0-9]{15,25}\Z"),
)
# Mostly the declared sources (the deep paths), sometimes any path segment.
SOURCES = ["github", "stripe", "billing", "orders", "ledger"]
fuzz_sources = st.tuples(
    st.integers(0, 15), st.text(alphabet="abcxyz%._-~", min_size=1, max_size=12)
).map(lambda p: SOURCES[p[0] % len(SOURCES)] if p[0] < 14 else p[1])
fuzz_content_types = st.one_of(
    st.sampled_from(
        [b"application/json"] * 6
        + [b"application/x+json; v=1", b"text/plain", b"", b"\xff", b"application/json;\xe9"]
    ),
    long_content_types,
)


def _nested(depth: int, shape: tuple[bytes, bytes], closed: bool) -> bytes:
    opening, closing = shape
    return opening * depth + (b"0" + closing * depth if closed else b"")


# JSON nested deeper than the interpreter's stack (a RecursionError in json.loads).
deep_json = st.builds(
    _nested,
    st.integers(1_000, 150_000),
    st.sampled_from([(b"[", b"]"), (b'{"id":', b"}"), (b'{"a":[', b"]}")]),
    st.booleans(),
)
fuzz_bodies = st.one_of(
    st.binary(max_size=2048),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=10,
    ).map(lambda value: json.dumps(value).encode()),
    deep_json,
)
FUZZ = settings(
    max_examples=1200,
    deadline=None,
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(
    source=fuzz_sources,
    method=st.integers(0, 15).map(lambda n: {14: "GET", 15: "PUT"}.get(n, "POST")),
    content_type=fuzz_content_types,
    content_length=st.one_of(st.none(), st.none(), odd_content_lengths),
    headers=fuzz_headers,
    body=fuzz_bodies,
)
async def test_fuzzed_headers_and_bodies_never_yield_a_5xx(
    keyed_client: httpx.AsyncClient,
    source: str,
    method: str,
    content_type: bytes,
    content_length: bytes | None,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> None:
    """Whatever arrives, the answer is a 2xx or a 4xx problem. Headers go out as raw bytes,
    as a server would receive them (a lying Content-Length included)."""
    raw = [(b"content-type", content_type), *headers]
    if content_length is not None:
        raw.append((b"content-length", content_length))
    request = keyed_client.build_request(method, f"/webhooks/{source}", content=body, headers=raw)
    response = await keyed_client.send(request)
    event(f"status {response.status_code}")
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert response.headers["content-type"] == "application/problem+json"


signed_keys = st.one_of(
    st.uuids().map(str),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-./:= ", min_size=1, max_size=60),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=300),
)
signed_content_types = st.one_of(
    st.sampled_from(
        ["application/json"] * 6 + ["application/x+json", "text/plain", "application/json;\xe9"]
    ),
    long_content_types.map(bytes.decode),
)


@settings(
    max_examples=500,
    deadline=None,
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    scheme=st.sampled_from(["github", "stripe", "billing", "orders", "ledger"]),
    key=signed_keys,
    body=fuzz_bodies,
    keyed=st.booleans(),
    # Margins of 10 s around the 300 s edge (the exact edges are unit-tested with a fixed
    # clock): the two sends of one example must fall on the same side of it, even when slow.
    skew_s=st.sampled_from([0, 0, 0, -290, 290, -310, 310, 10**9]),
    tamper=st.sampled_from([False] * 5 + [True]),
    content_type=signed_content_types,
    extra=st.lists(
        st.tuples(st.from_regex(r"\Ax-extra-[a-z]{1,8}\Z").map(str.encode), long_header_values),
        max_size=3,
    ),
)
async def test_fuzzed_signed_requests_never_yield_a_5xx_and_replay_consistently(
    keyed_client: httpx.AsyncClient,
    scheme: str,
    key: str,
    body: bytes,
    keyed: bool,
    skew_s: int,
    tamper: bool,
    content_type: str,
    extra: list[tuple[bytes, bytes]],
) -> None:
    """Correctly signed requests with odd keys, bodies, clocks and headers: 2xx/4xx, never a
    401 when fresh and untampered, and a repeat gets the same status (for a 202 the same
    body). Header values go out as the sender's UTF-8 bytes."""
    at = time.time() + skew_s
    if scheme == "ledger" and keyed:
        body = json.dumps({"id": key, "n": body.decode("latin-1")}).encode()
    if scheme == "github":
        headers = github_request(body, key)
    elif scheme == "stripe":
        headers = stripe_request(body, at=at)
    elif scheme == "billing":
        headers = billing_request(body, key, at=at)
    else:
        headers = orders_request(key)
    headers["Content-Type"] = content_type
    raw = [(k.encode(), v.encode("utf-8")) for k, v in headers.items()] + extra
    sent = body + b"!" if tamper else body

    async def send() -> httpx.Response:
        request = keyed_client.build_request(
            "POST", f"/webhooks/{scheme}", content=sent, headers=raw
        )
        return await keyed_client.send(request)

    first, second = await send(), await send()
    event(f"status {first.status_code} then {second.status_code}")
    for response in (first, second):
        assert response.status_code < 500, (response.status_code, response.text)
    if not tamper and abs(skew_s) < 300:
        assert first.status_code != 401, first.text  # signed right, and fresh
    if first.status_code == 202:
        assert second.status_code in (202, 422)  # 422: the same key came with another body
        if second.status_code == 202:
            assert second.content == first.content
            assert second.headers["idempotent-replayed"] == "true"
    elif first.status_code != 422:
        assert second.status_code == first.status_code


# -- end to end ---------------------------------------------------------------------------------


async def test_provider_retries_with_fresh_signatures_give_one_handler_side_effect(
    client: httpx.AsyncClient,
    hooks: App,
    store: ClaimStore,
    db_url: str,
    db: asyncpg.Connection,
    amqp_url: str,
) -> None:
    """receiver -> RabbitMQ -> worker: a delivery sent three times, each with a new timestamp
    and signature as providers retry, runs the handler once; so does a Stripe event."""
    await setup(db_url)
    body = json.dumps({"type": "invoice.paid", "data": {"invoice": "in_1"}}).encode()
    stripe_body = json.dumps({"id": "evt_e2e", "type": "charge.succeeded"}).encode()
    now = time.time()
    replies, signatures = [], set()
    for attempt in range(3):
        headers = billing_request(body, "msg_e2e", at=now - 200 + attempt * 100)
        signatures.add(headers["webhook-signature"])
        replies.append(await client.post("/webhooks/billing", content=body, headers=headers))
        headers = stripe_request(stripe_body, at=now - 200 + attempt * 100)
        replies.append(await client.post("/webhooks/stripe", content=stripe_body, headers=headers))
    assert len(signatures) == 3
    assert [r.status_code for r in replies] == [202] * 6
    assert [r.headers.get("idempotent-replayed") for r in replies] == [None, None] + ["true"] * 4

    # A receiver that crashed after publishing but before storing its reply publishes again
    # when the sender retries: the worker recognises the message id.
    channel = hooks.webhooks["billing"].channel
    await rabbitmq.publish(amqp_url, channel, [(body, {}, "billing/msg_e2e")])

    async with running(hooks, store, RabbitMQTransport(amqp_url)) as worker:

        async def settled() -> bool:
            return worker.stats.completed == 2 and worker.stats.duplicates == 1

        await eventually(settled)
    rows = await db.fetch("SELECT message_id, source, kind FROM webhook_events ORDER BY source")
    assert [tuple(r) for r in rows] == [
        ("billing/msg_e2e", "billing", "invoice.paid"),
        ("stripe/evt_e2e", "stripe", "charge.succeeded"),
    ]


async def test_the_receiver_publishes_to_kafka_with_the_same_guarantees(
    hooks: App, store: ClaimStore, db_url: str, db: asyncpg.Connection, channel: str
) -> None:
    """kafka://: three Stripe retries publish once (acks=all), and the worker on Kafka runs
    the handler once, a raw duplicate of the record included."""
    await setup(db_url)
    url = f"{KAFKA_URL}?group_id={channel}"
    body = json.dumps({"id": "evt_kafka", "type": "charge.succeeded"}).encode()
    publisher = KafkaPublisher(url)
    try:
        receiver = create_receiver(hooks, store=store, publisher=publisher)
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as http:
            now = time.time()
            replies = [
                await http.post(
                    "/webhooks/stripe", content=body, headers=stripe_request(body, at=now - i)
                )
                for i in range(3)
            ]
            assert [r.status_code for r in replies] == [202, 202, 202]
            assert [r.headers.get("idempotent-replayed") for r in replies] == [None, "true", "true"]
            assert (await http.get("/readyz")).status_code == 200
        # What a receiver that crashed before storing its reply would publish again.
        await publisher.publish(
            hooks.webhooks["stripe"].channel, body, message_id="stripe/evt_kafka", headers={}
        )
    finally:
        await publisher.close()

    async with running(hooks, store, KafkaTransport(url)) as worker:

        async def settled() -> bool:
            return worker.stats.completed == 1 and worker.stats.duplicates == 1

        await eventually(settled, timeout_s=60)
    rows = await db.fetch("SELECT message_id, kind FROM webhook_events")
    assert [tuple(r) for r in rows] == [("stripe/evt_kafka", "charge.succeeded")]


async def test_logs_hold_no_secret_no_signature_and_no_body(
    client: httpx.AsyncClient,
    publisher: CountingPublisher,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Accepted, replayed, forged, stale, conflicting and failed requests, logged at DEBUG
    (the AMQP client's frame dumps stay at INFO, as `dedupe-worker receive` sets them)."""
    caplog.set_level(logging.DEBUG)
    for noisy in ("aiormq", "aio_pika"):
        caplog.set_level(logging.INFO, logger=noisy)
    marker = "body-marker-4b1d"
    body = json.dumps({"id": "evt_log", "secret_field": marker}).encode()
    signatures: list[str] = []

    async def post(source: str, headers: dict[str, str], content: bytes = body) -> None:
        signatures.extend(
            v for k, v in headers.items() if "signature" in k.lower() or k == "Authorization"
        )
        await client.post(f"/webhooks/{source}", content=content, headers=headers)

    await post("github", github_request(body, "d-log"))
    await post("github", github_request(body, "d-log"))
    await post("github", github_request(body, "d-log", secret="forged"))
    await post("stripe", stripe_request(body, at=time.time() - 1000))
    await post("billing", billing_request(body, "m-log"))
    await post("billing", billing_request(body + b" ", "m-log"), body + b" ")
    publisher.fail_next = 1
    await post("orders", orders_request("o-log"))
    await post("orders", orders_request("o-log", api_key="wrong-key-77"))
    await post("orders", orders_request("o-log", api_key=API_KEY_B))

    assert caplog.records, "expected the receiver to log"
    text = caplog.text + " ".join(str(r.__dict__) for r in caplog.records)
    for secret in (*SECRETS, "wrong-key-77", marker, *signatures):
        assert secret not in text
    for signature in signatures:
        for token in re.findall(r"[A-Za-z0-9+/]{20,}", signature):
            assert token not in text
    for _, _, headers in publisher.published:
        assert not any(
            secret in value for value in headers.values() for secret in (*SECRETS, *signatures)
        )


# -- mounting and the command -------------------------------------------------------------------


async def test_a_mounted_receiver_opens_and_closes_its_own_store_and_publisher(
    hooks: App, db_url: str, amqp_url: str
) -> None:
    """Inside a user's Starlette app, the receiver's lifespan runs from the outer one."""
    receiver = create_receiver(
        hooks, database_url=db_url, publisher=lambda: RabbitMQPublisher(amqp_url)
    )

    @contextlib.asynccontextmanager
    async def lifespan(outer: Starlette) -> AsyncIterator[None]:
        async with receiver.router.lifespan_context(receiver):
            yield

    outer = Starlette(routes=[Mount("/hooks", app=receiver)], lifespan=lifespan)
    state = receiver.state.receiver
    async with lifespan(outer):
        assert state.store is not None and state.publisher is not None
        transport = httpx.ASGITransport(app=outer)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            body = b'{"ref":"main"}'
            response = await http.post(
                "/hooks/webhooks/github", content=body, headers=github_request(body, "d-m")
            )
            assert response.status_code == 202
            assert (await http.get("/hooks/readyz")).status_code == 200
    assert state.store is None and state.publisher is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def receive_process(
    secrets: None, db_url: str, amqp_url: str, channel: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    port = free_port()
    log = tmp_path / "receiver.log"
    env = {
        **os.environ,
        "DEDUPE_DATABASE_URL": db_url,
        "DEDUPE_BROKER_URL": amqp_url,
        "DEDUPE_LOG_LEVEL": "DEBUG",
        "PYTHONPATH": CHECKOUT_PATH,
        "RECEIVER_TEST_CHANNEL": channel,
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dedupe.cli",
                "receive",
                "tests.integration.test_receiver:cli_app",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    yield proc, port, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


# The app `dedupe-worker receive` loads in the test below: one source, on the channel the
# test passes down (read at import, in the subprocess only).
cli_app = App("cli")
cli_app.webhook(
    "github",
    verify=github(secret=env("GITHUB_WEBHOOK_SECRET")),
    channel=os.environ.get("RECEIVER_TEST_CHANNEL", "t-cli"),
)


async def test_dedupe_worker_receive_serves_webhooks_and_stops_on_sigterm(
    receive_process: tuple[subprocess.Popen[bytes], int, Path], amqp_url: str, channel: str
) -> None:
    """The real command: uvicorn on 127.0.0.1, a delivery and its replay, a clean SIGTERM."""
    proc, port, log = receive_process
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:

        async def up() -> bool:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                return (await http.get("/readyz")).status_code == 200
            return False

        await eventually(up, interval_s=0.2)
        body = b'{"zen":"Keep it logically awesome."}'
        first = await http.post(
            "/webhooks/github", content=body, headers=github_request(body, "d-cli")
        )
        second = await http.post(
            "/webhooks/github", content=body, headers=github_request(body, "d-cli")
        )
        assert (first.status_code, second.status_code) == (202, 202)
        assert second.headers["idempotent-replayed"] == "true"
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(asyncio.to_thread(proc.wait), 15) == 0
    output = log.read_text()
    assert "receiver stopped" in output
    assert GH_SECRET not in output
    assert "Keep it logically" not in output  # DEBUG logs, yet no body
    assert await queue_depth(amqp_url, channel) == 1
