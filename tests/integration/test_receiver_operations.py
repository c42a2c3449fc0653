"""The receiver's /metrics and /status, who may see the page and release a key from it, its
log lines, and the options of `dedupe-worker receive` that shape them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from dedupe.app import App
from dedupe.claims.store import ClaimStore
from dedupe_receiver.application import create_receiver
from tests.conftest import CHECKOUT_PATH, ROOT, eventually
from tests.integration.test_receiver import (  # noqa: F401 - fixtures
    CountingPublisher,
    assert_problem,
    free_port,
    github_request,
    hooks,
    orders_request,
    publisher,
    secrets,
)

FORM = {"scope": "shop.charge", "key": "k-1"}
LOCAL = "http://127.0.0.1:8080"
SAME_SITE = {"origin": LOCAL}


def http(asgi: object, client_host: str = "127.0.0.1", base_url: str = LOCAL) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=asgi, client=(client_host, 40000))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url=base_url)


@pytest.fixture
async def stuck(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute(
        """INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, lease_until,
                                      created_at, claimed_at, expires_at)
           VALUES ('shop.charge', 'k-1', '\\x00', 'in_progress', 'gone', now(),
                   now() - interval '1 hour', now() - interval '1 hour',
                   now() + interval '1 day')"""
    )
    return db


async def released(db: asyncpg.Connection) -> bool:
    return bool(await db.fetchval("SELECT retryable FROM dedupe_claims WHERE key = 'k-1'"))


# -- /metrics --------------------------------------------------------------------------------


async def test_metrics_count_webhook_outcomes_and_time_the_claims(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
) -> None:
    """/metrics serves the receiver's counters, and each claim lands in the claim latency
    histogram the workers use, labelled with the source's scope."""
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    body = json.dumps({"ref": "main"}).encode()
    async with http(receiver) as client:
        for _ in range(3):
            sent = await client.post(
                "/webhooks/github", content=body, headers=github_request(body, "d-1")
            )
            assert sent.status_code == 202
        metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'dedupe_webhook_requests_total{outcome="accepted"} 1.0' in metrics.text
    assert 'dedupe_webhook_requests_total{outcome="replayed"} 2.0' in metrics.text
    assert 'dedupe_claim_seconds_count{handler="hooks.webhook:github"} 3.0' in metrics.text


# -- who sees /status and who releases from it --------------------------------------------------


async def test_without_a_token_a_remote_client_can_neither_see_the_page_nor_release(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    """The webhook port faces the senders: keys, tenants and errors are for operators only."""
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    async with http(receiver, "10.1.2.3") as remote:
        for path in ("/status", "/status?token=guess"):
            page = await remote.get(path)
            assert page.status_code == 403
            assert "k-1" not in page.text and "shop.charge" not in page.text
        refused = await remote.post("/status/release", data=FORM, headers=SAME_SITE)
        assert refused.status_code == 403
    assert not await released(stuck)


async def test_without_a_token_only_a_same_site_form_from_loopback_releases(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    """Loopback clients see the page; a release needs the page's own Origin: none, another
    site's or "null" (a sandboxed frame, a file: page) is refused."""
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    for host in ("127.0.0.2", "::1", "::ffff:127.0.0.1"):
        async with http(receiver, host) as local:
            page = await local.get("/status")
            assert page.status_code == 200 and "class='release'" in page.text, host
    async with http(receiver) as local:
        for origin in (None, "http://evil.example", "null"):
            headers = {"origin": origin} if origin else {}
            refused = await local.post("/status/release", data=FORM, headers=headers)
            assert refused.status_code == 403, origin
        assert not await released(stuck)
        done = await local.post("/status/release", data=FORM, headers=SAME_SITE)
        assert done.status_code == 303
        assert "released=shop.charge" in done.headers["location"]
    assert await released(stuck)


async def test_with_a_token_a_remote_client_needs_it_to_see_the_page_and_to_release(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    """?token= opens the page from anywhere; a loopback client sees it without, but only
    the token releases (a script may omit Origin, never send "null")."""
    receiver = create_receiver(hooks, store=store, publisher=publisher, status_token="s3cret")
    async with http(receiver, "10.1.2.3") as remote:
        for path in ("/status", "/status?token=guess", "/status?token=%C3%A9"):
            assert (await remote.get(path)).status_code == 403, path
        page = await remote.get("/status?token=s3cret")
        assert page.status_code == 200 and "class='release'" in page.text
        null = await remote.post(
            "/status/release", data={**FORM, "token": "s3cret"}, headers={"origin": "null"}
        )
        assert null.status_code == 403
    async with http(receiver) as local:
        page = await local.get("/status")
        assert page.status_code == 200 and "class='release'" not in page.text
        wrong = await local.post("/status/release", data={**FORM, "token": "guess"})
        assert wrong.status_code == 403
    assert not await released(stuck)
    async with http(receiver, "10.1.2.3") as remote:
        done = await remote.post("/status/release", data={**FORM, "token": "s3cret"})
        assert done.status_code == 303
    assert await released(stuck)


async def test_an_empty_status_token_is_no_token(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    """status_token="" (an empty DEDUPE_STATUS_TOKEN) protects like no token at all: ?token=
    opens nothing for a remote client and releases nothing."""
    receiver = create_receiver(hooks, store=store, publisher=publisher, status_token="")
    async with http(receiver, "10.1.2.3") as remote:
        for path in ("/status?token=", "/status"):
            assert (await remote.get(path)).status_code == 403, path
        for url, form in (
            ("/status/release?token=", FORM),
            ("/status/release", {**FORM, "token": ""}),
        ):
            refused = await remote.post(url, data=form, headers=SAME_SITE)
            assert refused.status_code == 403, url
    assert not await released(stuck)


async def test_a_loopback_client_naming_another_host_needs_the_token(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example;
    only localhost, 127.x and [::1] in Host make a loopback client an operator."""
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    for base in ("http://localhost:8080", "http://127.0.0.5", "http://[::1]:8080"):
        async with http(receiver, base_url=base) as local:
            assert (await local.get("/status")).status_code == 200, base
    for base in ("http://evil.example:8080", "http://127.0.0.1.evil.example", "http://[::2]"):
        async with http(receiver, base_url=base) as rebound:
            page = await rebound.get("/status")
            assert page.status_code == 403 and "k-1" not in page.text, base
            refused = await rebound.post("/status/release", data=FORM, headers={"origin": base})
            assert refused.status_code == 403, base
    assert not await released(stuck)
    guarded = create_receiver(hooks, store=store, publisher=publisher, status_token="s3cret")
    async with http(guarded, base_url="http://evil.example") as rebound:
        assert (await rebound.get("/status")).status_code == 403
        assert (await rebound.get("/status?token=s3cret")).status_code == 200


@pytest.mark.parametrize(
    "proxy", [{"x-forwarded-for": "127.0.0.1"}, {"forwarded": "for=127.0.0.1"}]
)
async def test_a_request_through_a_proxy_is_never_taken_for_loopback(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
    proxy: dict[str, str],
) -> None:
    """With X-Forwarded-For or Forwarded the client address is the proxy's word (uvicorn
    with FORWARDED_ALLOW_IPS='*' takes it as the client): it needs the token."""
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    async with http(receiver) as local:
        assert (await local.get("/status", headers=proxy)).status_code == 403
        refused = await local.post("/status/release", data=FORM, headers={**SAME_SITE, **proxy})
        assert refused.status_code == 403
    assert not await released(stuck)


async def test_a_release_is_judged_before_its_form_is_read_and_the_form_is_small(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    """A stranger's release is refused without reading its body; a big or broken form is a
    4xx; a client gone mid-form is a 400, never a 500."""
    read: list[bytes] = []

    async def body() -> AsyncIterator[bytes]:
        read.append(b"scope=")
        yield b"scope="
        yield b"x" * 10_000_000

    receiver = create_receiver(hooks, store=store, publisher=publisher)
    async with http(receiver, "10.1.2.3") as remote:
        refused = await remote.post(
            "/status/release",
            content=body(),
            headers={**SAME_SITE, "content-type": "application/x-www-form-urlencoded"},
        )
        assert refused.status_code == 403
    assert read == []

    guarded = create_receiver(hooks, store=store, publisher=publisher, status_token="s3cret")
    async with http(guarded, "10.1.2.3") as remote:
        wrong = await remote.post("/status/release?token=guess", content=body(), headers=SAME_SITE)
        assert wrong.status_code == 403 and read == []
        big = await remote.post("/status/release", data={**FORM, "pad": "x" * 20_000})
        assert big.status_code == 413
        many = await remote.post(
            "/status/release",
            content="&".join(f"f{i}=1" for i in range(50)),
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert many.status_code == 400
        streamed = await remote.post(
            "/status/release",
            content=body(),
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert streamed.status_code == 400
        by_query = await remote.post("/status/release?token=s3cret", data=FORM)
        assert by_query.status_code == 303
    assert await released(stuck)

    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"scope=shop.charge&key=", "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/status/release",
        "raw_path": b"/status/release",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8080"),
            (b"origin", LOCAL.encode()),
            (b"content-type", b"application/x-www-form-urlencoded"),
            (b"content-length", b"100"),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8080),
    }
    await receiver(scope, receive, send)
    assert sent[0]["status"] == 400


async def test_status_and_metrics_can_be_left_off_the_webhook_port(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    stuck: asyncpg.Connection,
) -> None:
    """serve_status=False and serve_metrics=False: 404s, even for loopback, webhooks served."""
    receiver = create_receiver(
        hooks, store=store, publisher=publisher, serve_status=False, serve_metrics=False
    )
    async with http(receiver) as local:
        for path in ("/status", "/metrics"):
            assert_problem(await local.get(path), 404, "http-error")
        gone = await local.post("/status/release", data=FORM, headers=SAME_SITE)
        assert_problem(gone, 404, "http-error")
        assert (await local.get("/healthz")).status_code == 200
        body = b'{"ref":"main"}'
        sent = await local.post("/webhooks/github", content=body, headers=github_request(body, "d"))
        assert sent.status_code == 202
    assert not await released(stuck)


# -- log lines ------------------------------------------------------------------------------------


async def test_request_log_lines_carry_scope_key_message_id_and_outcome(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Accepted, replayed, conflicting, failed and unauthenticated requests are logged with
    the structured fields dedupe.observability.logs prints (and a 401 with what it knows: the
    source)."""
    caplog.set_level(logging.DEBUG, logger="dedupe_receiver")
    receiver = create_receiver(hooks, store=store, publisher=publisher)
    async with http(receiver) as client:
        for body in (b'{"n":1}', b'{"n":1}', b'{"n":2}'):
            await client.post("/webhooks/orders", content=body, headers=orders_request("o-1"))
        publisher.fail_next = 1
        await client.post("/webhooks/orders", content=b"{}", headers=orders_request("o-2"))
        await client.post(
            "/webhooks/orders", content=b"{}", headers=orders_request("o-3", api_key="nope")
        )
    lines = [r for r in caplog.records if r.name == "dedupe_receiver" and hasattr(r, "outcome")]
    fields = [
        (r.outcome, getattr(r, "scope", None), getattr(r, "key", None), r.source)  # type: ignore[attr-defined]
        for r in lines
    ]
    scope = "hooks.webhook:orders/tenant-a"
    assert fields == [
        ("accepted", scope, "o-1", "orders"),
        ("replayed", scope, "o-1", "orders"),
        ("conflict", scope, "o-1", "orders"),
        ("broker_unavailable", scope, "o-2", "orders"),
        ("unauthenticated", None, None, "orders"),
    ]
    assert {getattr(r, "message_id", None) for r in lines[:3]} == {"orders/tenant-a/o-1"}


# -- `dedupe-worker receive` -----------------------------------------------------------------------


@pytest.fixture
def quiet_receive_process(
    secrets: None,  # noqa: F811
    db_url: str,
    amqp_url: str,
    channel: str,
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """`dedupe-worker receive` with the claims gauges every 0.2 s and no /status."""
    port = free_port()
    log = tmp_path / "receiver.log"
    env = {
        **os.environ,
        "DEDUPE_DATABASE_URL": db_url,
        "DEDUPE_BROKER_URL": amqp_url,
        "DEDUPE_METRICS_INTERVAL_S": "0.2",
        "DEDUPE_RECEIVER_NO_STATUS": "true",
        "PYTHONPATH": CHECKOUT_PATH,
        "RECEIVER_TEST_CHANNEL": channel,
    }
    command = [sys.executable, "-m", "dedupe.cli", "receive"]
    command += ["tests.integration.test_receiver:cli_app", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    yield proc, port, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


async def test_dedupe_worker_receive_honours_the_metrics_interval_and_can_hide_status(
    quiet_receive_process: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    """DEDUPE_METRICS_INTERVAL_S reaches the receiver (the claims gauges refresh at that
    pace) and DEDUPE_RECEIVER_NO_STATUS=true takes /status off the webhook port."""
    proc, port, log = quiet_receive_process
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

        async def up() -> bool:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                return (await client.get("/readyz")).status_code == 200
            return False

        await eventually(up, interval_s=0.2)
        assert (await client.get("/status")).status_code == 404

        async def checked_at() -> float:
            text = (await client.get("/metrics")).text
            found = re.search(r"^dedupe_claims_checked_timestamp_seconds (\S+)$", text, re.M)
            return float(found.group(1)) if found else 0.0

        first = await checked_at()
        await asyncio.sleep(0.6)
        assert await checked_at() > first  # at the default 15 s it would not have moved
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(asyncio.to_thread(proc.wait), 15) == 0
