"""The receiver when PostgreSQL hangs or fails in unforeseen ways, and when it has a bug of
its own: a prompt 503 with Retry-After for outages, a logged 500 problem for bugs, and
never a request that waits for ever."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import asyncpg
import httpx
import pytest

from dedupe import App
from dedupe.claims.records import Claim, ClaimRequest
from dedupe.claims.store import ClaimStore
from dedupe.errors import ConfigurationError
from dedupe.message import Headers
from dedupe.webhooks import Verified
from dedupe_receiver.application import create_receiver
from tests.integration.test_receiver import (  # noqa: F401 - fixtures
    CountingPublisher,
    assert_problem,
    hooks,
    orders_request,
    publisher,
    secrets,
)

STORE_TIMEOUT_S = 0.5
# A prompt answer: the store timeout, PostgreSQL acknowledging the cancel, and slack.
PROMPT_S = 3.0


@dataclass
class HookedPublisher:
    """The counting publisher, running `before` (e.g. taking a row lock) on each publish."""

    inner: CountingPublisher
    before: Callable[[], Awaitable[None]]

    async def publish(
        self, channel: str, body: bytes, *, message_id: str, headers: Mapping[str, str]
    ) -> None:
        await self.before()
        await self.inner.publish(channel, body, message_id=message_id, headers=headers)

    async def close(self) -> None:
        pass  # the inner one is the fixture's


def client_of(receiver: object) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=receiver)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://r")


async def timed(request: Awaitable[httpx.Response]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await asyncio.wait_for(request, timeout=30)  # before the fix: for ever
    return response, time.monotonic() - started


@pytest.fixture
async def locker(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A second session whose open transaction holds locks until the test lets go."""
    conn = await asyncpg.connect(db_url)
    transaction = conn.transaction()
    await transaction.start()
    yield conn
    await transaction.rollback()
    await conn.close()


# -- a hanging database ------------------------------------------------------------------------


async def test_a_claim_that_hangs_is_a_prompt_503_and_the_next_request_succeeds(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    locker: asyncpg.Connection,
    db: asyncpg.Connection,
) -> None:
    """The claims table is locked: the claim gives up after store_timeout_s (503 +
    Retry-After), nothing is published, and once the lock goes the retry is accepted."""
    await locker.execute("LOCK TABLE dedupe_claims IN ACCESS EXCLUSIVE MODE")
    receiver = create_receiver(
        hooks, store=store, publisher=publisher, store_timeout_s=STORE_TIMEOUT_S
    )
    body = b'{"n":1}'
    async with client_of(receiver) as http:
        response, took_s = await timed(
            http.post("/webhooks/orders", content=body, headers=orders_request("k-hang"))
        )
        assert_problem(response, 503, "store-unavailable")
        assert int(response.headers["retry-after"]) > 0
        assert STORE_TIMEOUT_S <= took_s < PROMPT_S
        await locker.execute("ROLLBACK")
        await locker.execute("BEGIN")  # for the fixture's own rollback
        retried = await http.post(
            "/webhooks/orders", content=body, headers=orders_request("k-hang")
        )
        assert retried.status_code == 202, retried.text
    assert [m for _, m, _ in publisher.published] == ["orders/tenant-a/k-hang"]
    assert receiver.state.receiver.stats["store_unavailable"] == 1


async def test_a_reply_that_cannot_be_stored_in_time_is_still_a_prompt_202(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    locker: asyncpg.Connection,
) -> None:
    """The key's row is locked while the message is published: storing the reply gives up
    after store_timeout_s, and the confirmed publish is answered 202 all the same."""

    async def lock_the_row() -> None:
        await locker.execute("SELECT 1 FROM dedupe_claims WHERE key = 'k-store' FOR UPDATE")

    hooked = HookedPublisher(publisher, lock_the_row)
    receiver = create_receiver(
        hooks, store=store, publisher=hooked, store_timeout_s=STORE_TIMEOUT_S
    )
    async with client_of(receiver) as http:
        response, took_s = await timed(
            http.post("/webhooks/orders", content=b'{"n":1}', headers=orders_request("k-store"))
        )
    assert response.status_code == 202, response.text
    assert STORE_TIMEOUT_S <= took_s < PROMPT_S
    assert len(publisher.published) == 1


async def test_a_locked_reply_row_holds_up_no_other_requests_reply(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    locker: asyncpg.Connection,
) -> None:
    """One key's row is locked elsewhere while twenty other keys publish beside it: their
    replies, which share statements with its reply, are stored at once and answered at once;
    only the locked one waits out the store timeout (then 202 all the same)."""
    store_timeout_s = 3.0
    row_locked = asyncio.Event()

    async def lock_one_row() -> None:
        if not row_locked.is_set():  # the first publish: the locked key's
            await locker.execute("SELECT 1 FROM dedupe_claims WHERE key = 'k-locked' FOR UPDATE")
            row_locked.set()

    hooked = HookedPublisher(publisher, lock_one_row)
    publisher.delay_s = 0.05  # the publishes end together: their replies queue together
    receiver = create_receiver(
        hooks, store=store, publisher=hooked, store_timeout_s=store_timeout_s
    )
    body = b'{"n":1}'
    async with client_of(receiver) as http:
        locked = asyncio.create_task(
            timed(http.post("/webhooks/orders", content=body, headers=orders_request("k-locked")))
        )
        await asyncio.wait_for(row_locked.wait(), 10)  # before the others publish
        others = await asyncio.gather(
            *(
                timed(http.post("/webhooks/orders", content=body, headers=orders_request(f"k-{i}")))
                for i in range(20)
            )
        )
        assert [r.status_code for r, _ in others] == [202] * 20
        slowest = max(took for _, took in others)
        assert slowest < store_timeout_s / 2, f"a reply waited for the locked row: {slowest:.2f} s"
        replays = [
            await http.post("/webhooks/orders", content=body, headers=orders_request(f"k-{i}"))
            for i in range(20)
        ]
        assert [r.headers.get("idempotent-replayed") for r in replays] == ["true"] * 20
        response, took_s = await locked
    assert response.status_code == 202, response.text
    assert took_s >= store_timeout_s
    assert len(publisher.published) == 21


async def test_a_release_that_hangs_after_a_failed_publish_is_still_a_prompt_503(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    locker: asyncpg.Connection,
    db: asyncpg.Connection,
) -> None:
    """The broker fails and the key's row is locked: giving the key back gives up after
    store_timeout_s, and the sender gets its 503 (the lease lapses by itself)."""

    async def lock_the_row() -> None:
        await locker.execute("SELECT 1 FROM dedupe_claims WHERE key = 'k-back' FOR UPDATE")

    publisher.fail_next = 1
    hooked = HookedPublisher(publisher, lock_the_row)
    receiver = create_receiver(
        hooks, store=store, publisher=hooked, store_timeout_s=STORE_TIMEOUT_S
    )
    async with client_of(receiver) as http:
        response, took_s = await timed(
            http.post("/webhooks/orders", content=b'{"n":1}', headers=orders_request("k-back"))
        )
    assert_problem(response, 503, "broker-unavailable")
    assert STORE_TIMEOUT_S <= took_s < PROMPT_S
    released = await db.fetchval("SELECT lease_until <= now() FROM dedupe_claims")
    assert released is False  # not given back: the lease runs out instead


def test_the_store_timeout_must_be_positive(hooks: App) -> None:  # noqa: F811
    """store_timeout_s=0 would fail every request: refused when the receiver is made."""
    with pytest.raises(ConfigurationError, match="store_timeout_s"):
        create_receiver(hooks, publisher=lambda: None, store_timeout_s=0)  # type: ignore[arg-type,return-value]


# -- failures nobody foresaw ---------------------------------------------------------------------


class BrokenStore(ClaimStore):
    """The real store on the real pool, whose claim fails with an error no one wrapped."""

    async def claim_batch(
        self, requests: Sequence[ClaimRequest], *, lease_s: float, retention_s: float
    ) -> list[Claim]:
        raise RuntimeError("a driver error nobody wrapped in StoreError")


async def test_a_store_failing_in_an_unforeseen_way_is_a_503_not_a_500(
    hooks: App,  # noqa: F811
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
) -> None:
    """Any failure of the claim is an outage of ours: 503 store-unavailable, Retry-After."""
    broken = BrokenStore(store.pool, owner="broken")
    receiver = create_receiver(hooks, store=broken, publisher=publisher)
    async with client_of(receiver) as http:
        response = await http.post(
            "/webhooks/orders", content=b'{"n":1}', headers=orders_request("k")
        )
    assert_problem(response, 503, "store-unavailable")
    assert int(response.headers["retry-after"]) > 0
    assert publisher.published == []


class BuggyVerifier:
    """A verifier of the user's own with a bug in it."""

    challenge = None

    def __call__(self, headers: Headers, body: bytes) -> Verified:
        raise ZeroDivisionError("a bug in a verifier")

    def check(self) -> None:
        pass


async def test_a_bug_is_a_logged_500_problem_not_a_text_page(
    store: ClaimStore,
    publisher: CountingPublisher,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unexpected exception answers application/problem+json 500 and is logged once,
    with its traceback, and without the body."""
    app = App("buggy")
    app.webhook("custom", verify=BuggyVerifier(), channel="t-never-published")
    receiver = create_receiver(app, store=store, publisher=publisher)
    marker = "body-marker-9c1f"
    async with client_of(receiver) as http:
        response = await http.post(
            "/webhooks/custom",
            content=f'{{"secret":"{marker}"}}'.encode(),
            headers={"Content-Type": "application/json"},
        )
    document = assert_problem(response, 500, "internal-error")
    assert "ZeroDivisionError" not in str(document)  # the client learns nothing of the bug
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError
    assert getattr(record, "outcome", None) == "internal_error"
    assert marker not in caplog.text
