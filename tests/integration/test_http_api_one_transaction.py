"""IdempotencyMiddleware(one_transaction=True) on a real uvicorn server and PostgreSQL: a new
key's claim, the endpoint's writes, its publishes and its stored response commit in one
transaction; a concurrent duplicate waits on the row lock, then replays (or gets its 409 past
lock_timeout); answers that give the key back roll everything back and the retry runs on two
commits as attempt 2; the bound cuts a long run off with a 503; a kill -9 or a frozen process
mid-endpoint leaves no claim behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from dedupe.asgi import one_transaction
from dedupe.errors import ConfigurationError
from tests.apps.http_api import create_test_api
from tests.conftest import eventually
from tests.integration.http_server import ApiProcesses, serving
from tests.integration.test_http_api import client_of, orders, post


@pytest.fixture(params=["read first", "claim first"])
async def api(
    orders_db: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    """The test API in one-transaction mode (lease 30 s: bound 30 s, lock_timeout 2 s), on
    each of the paths one_transaction.ReadFirst chooses between: the key's row read first in
    the shared look-up, or the claim in the transaction straight away (its read answers)."""
    monkeypatch.setattr(
        one_transaction, "READ_FIRST_SHARE", -1.0 if request.param == "read first" else 2.0
    )
    async with (
        serving(create_test_api(orders_db, one_transaction=True)) as base,
        client_of(base) as client,
    ):
        yield client


async def claim_row(db: asyncpg.Connection, key: str) -> dict[str, Any] | None:
    row = await db.fetchrow(
        "SELECT status, attempts, error, lease_until <= now() AS lapsed FROM dedupe_claims"
        " WHERE key = $1",
        key,
    )
    return None if row is None else dict(row)


async def waiting_on_a_lock(db: asyncpg.Connection) -> int:
    return int(
        await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
        )
    )


async def open_transactions(db: asyncpg.Connection) -> int:
    """Sessions of the API in a transaction (the one-transaction runs under way)."""
    return int(
        await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'dedupe-worker' AND xact_start IS NOT NULL"
            " AND pid <> pg_backend_pid()"
        )
    )


# -- one commit ----------------------------------------------------------------------------


COMMIT_LOG = """
CREATE TABLE commit_log (xid xid8 PRIMARY KEY);
CREATE FUNCTION log_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO commit_log VALUES (pg_current_xact_id()) ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;
CREATE TRIGGER claims_commits AFTER INSERT OR UPDATE ON dedupe_claims
    FOR EACH STATEMENT EXECUTE FUNCTION log_commit();
CREATE TRIGGER orders_commits AFTER INSERT OR UPDATE ON orders
    FOR EACH STATEMENT EXECUTE FUNCTION log_commit();
"""


async def test_a_new_key_commits_once_where_two_commits_commit_twice(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """Every transaction that writes a claim or an order logs its id in a row of its own
    (a statement trigger), which exists only if it committed: 40 new keys commit 40 such
    transactions in one-transaction mode, 80 on the two-commit path; replays commit none."""
    await db.execute(COMMIT_LOG)
    n = 40
    counts = {}
    for one in (True, False):
        before = await db.fetchval("SELECT count(*) FROM commit_log")
        async with (
            serving(create_test_api(orders_db, one_transaction=one)) as base,
            client_of(base) as client,
        ):
            for i in range(n):
                answer = await post(client, f"c-{one}-{i}", {"sku": "book"})
                assert answer.status_code == 201, answer.text
            counts[one] = await db.fetchval("SELECT count(*) FROM commit_log") - before
            if one:  # a replay is answered from the claim's read, in a transaction rolled back
                for i in range(n):
                    replay = await post(client, f"c-{one}-{i}", {"sku": "book"})
                    assert replay.headers["idempotent-replayed"] == "true"
                assert await db.fetchval("SELECT count(*) FROM commit_log") - before == n
    assert counts == {True: n, False: 2 * n}
    assert await db.fetchval("SELECT count(*) FROM orders") == 2 * n


async def test_nothing_of_a_request_is_visible_until_its_response_commits(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """While the endpoint runs, neither its claim nor its order exists for anyone else; then
    both, the claim completed with the response, in the same transaction (the same xmin)."""
    first = asyncio.ensure_future(post(api, "v-1", {}, "/slow", params={"s": 0.6}))
    await eventually(lambda: open_transactions(db))
    await asyncio.sleep(0.2)
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 0
    assert await db.fetchval("SELECT count(*) FROM orders") == 0
    answer = await first
    assert answer.status_code == 201
    claim_xmin, order_xmin = await db.fetchrow(
        "SELECT (SELECT xmin::text FROM dedupe_claims), (SELECT xmin::text FROM orders)"
    )
    assert claim_xmin == order_xmin
    assert await claim_row(db, "v-1") == {
        "status": "completed",
        "attempts": 1,
        "error": None,
        "lapsed": None,
    }


async def test_a_finished_key_replays_and_another_request_under_it_is_a_422(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    first = await post(api, "r-1", {"sku": "pen"})
    again = await post(api, "r-1", {"sku": "pen"})
    other = await post(api, "r-1", {"sku": "ink"})
    assert first.status_code == again.status_code == 201
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"]
    assert other.status_code == 422
    assert await orders(db) == [("pen", "r-1")]


# -- concurrent duplicates -----------------------------------------------------------------


async def test_a_concurrent_duplicate_waits_on_the_row_lock_then_replays(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """The duplicate's claim waits on the first one's uncommitted row (seen in
    pg_stat_activity), then finds it completed: the first answer again, one order."""
    first = asyncio.ensure_future(post(api, "d-1", {}, "/slow", params={"s": 0.8}))
    await eventually(lambda: open_transactions(db))
    started = time.monotonic()
    duplicate = asyncio.ensure_future(post(api, "d-1", {}, "/slow", params={"s": 0.8}))
    await eventually(lambda: waiting_on_a_lock(db))
    one, two = await first, await duplicate
    assert one.status_code == two.status_code == 201
    assert two.content == one.content and two.headers["idempotent-replayed"] == "true"
    assert time.monotonic() - started > 0.3  # it waited for the first
    assert await db.fetchval("SELECT count(*) FROM orders") == 1


async def test_a_concurrent_request_with_another_body_waits_then_gets_422(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    first = asyncio.ensure_future(post(api, "d-2", {"a": 1}, "/slow", params={"s": 0.6}))
    await eventually(lambda: open_transactions(db))
    other = asyncio.ensure_future(post(api, "d-2", {"a": 2}, "/slow", params={"s": 0.6}))
    await eventually(lambda: waiting_on_a_lock(db))
    one, two = await first, await other
    assert one.status_code == 201 and two.status_code == 422, two.text
    assert await db.fetchval("SELECT count(*) FROM orders") == 1


async def test_twenty_concurrent_copies_make_one_order(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    answers = await asyncio.gather(*(post(api, "many", {"sku": "book"}) for _ in range(20)))
    assert {a.status_code for a in answers} == {201}
    assert len({a.content for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 19
    assert await orders(db) == [("book", "many")]


async def test_a_duplicate_that_waits_past_lock_timeout_gets_409(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """lease_s=3: lock_timeout 1 s. The duplicate of a request that runs 2.5 s gives up
    waiting with 409 in-flight and Retry-After: 1; the first completes; the retry replays."""
    asgi = create_test_api(orders_db, one_transaction=True, lease_s=3.0)
    async with serving(asgi) as base, client_of(base) as client:
        first = asyncio.ensure_future(post(client, "t-1", {}, "/slow", params={"s": 2.5}))
        await eventually(lambda: open_transactions(db))
        started = time.monotonic()
        duplicate = await post(client, "t-1", {}, "/slow", params={"s": 2.5})
        waited = time.monotonic() - started
        one = await first
        retry = await post(client, "t-1", {}, "/slow", params={"s": 2.5})
    assert duplicate.status_code == 409, duplicate.text
    assert duplicate.headers["retry-after"] == "1"
    assert duplicate.json()["type"] == "urn:dedupe-worker:problem:in-flight"
    assert 0.9 < waited < 2.4
    assert one.status_code == 201 and retry.content == one.content
    assert retry.headers["idempotent-replayed"] == "true"
    assert await db.fetchval("SELECT count(*) FROM orders") == 1


# -- answers that give the key back --------------------------------------------------------


async def test_a_status_not_stored_rolls_back_and_leaves_the_key_free(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """A 429 reaches the client with its headers; its order rolls back with its claim; the key
    is free (handed back, its lease over) and the retry runs at once, as attempt 2."""
    limited = await post(api, "n-1", {}, "/answer/429")
    assert limited.status_code == 429 and limited.headers["retry-after"] == "7"
    assert await db.fetchval("SELECT count(*) FROM orders") == 0
    assert await claim_row(db, "n-1") == {
        "status": "in_progress",
        "attempts": 1,
        "error": "handed back",
        "lapsed": True,
    }
    again = await post(api, "n-1", {}, "/answer/429")
    assert again.status_code == 429 and "idempotent-replayed" not in again.headers
    assert await db.fetchval("SELECT count(*) FROM orders") == 0
    assert (await claim_row(db, "n-1") or {}).get("attempts") == 2


async def test_a_5xx_rolls_back_and_the_retry_runs_as_attempt_2(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    failed = await post(api, "f-1", {}, "/flaky")
    assert failed.status_code == 503
    assert await db.fetchval("SELECT count(*) FROM orders") == 0
    retry = await post(api, "f-1", {}, "/flaky")
    assert retry.status_code == 201 and retry.json()["attempt"] == 2
    replay = await post(api, "f-1", {}, "/flaky")
    assert replay.content == retry.content and replay.headers["idempotent-replayed"] == "true"
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
    boom = await post(api, "f-2", {}, "/boom")
    assert boom.status_code == 500
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
    assert (await claim_row(db, "f-2") or {}).get("error") == "handed back"


async def test_counting_a_failed_attempt_waits_no_longer_than_the_claim_behind_a_duplicate(
    orders_db: str, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """lease_s=30: lock_timeout 2 s. The first request's endpoint answers 503 after 0.5 s
    while its duplicate waits on its row; the rollback lets the duplicate claim the key and run
    for 6 s. Counting the failed attempt (first_attempt_failed) then meets the duplicate's open
    row: like the claim, it waits at most lock_timeout and leaves the key to the run that holds
    it (whose outcome decides), instead of holding the 503 back for the 5 s store timeout and
    logging a failure. The duplicate completes as attempt 1; a retry replays it."""
    asgi = create_test_api(orders_db, one_transaction=True)
    with caplog.at_level(logging.INFO, logger="dedupe.asgi"):
        async with serving(asgi) as base, client_of(base) as client:
            started = time.monotonic()
            first = asyncio.ensure_future(
                post(client, "w-1", {}, "/late", headers={"X-Pause-S": "0.5", "X-Answer": "503"})
            )
            await eventually(lambda: open_transactions(db))
            duplicate = asyncio.ensure_future(
                post(client, "w-1", {}, "/late", headers={"X-Pause-S": "6"})
            )
            await eventually(lambda: waiting_on_a_lock(db))
            failed = await first
            failed_after = time.monotonic() - started
            ran = await duplicate
            retry = await post(client, "w-1", {}, "/late")
    assert failed.status_code == 503, failed.text  # the endpoint's own answer
    assert failed_after < 4.0, failed_after  # 0.5 s + lock_timeout, not + the 5 s timeout
    assert ran.status_code == 201, ran.text
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == ran.content
    assert await orders(db) == [("late", "w-1")]
    assert await claim_row(db, "w-1") == {
        "status": "completed",
        "attempts": 1,
        "error": None,
        "lapsed": None,
    }
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        r.getMessage() for r in caplog.records
    ]
    assert any("held by another request" in r.getMessage() for r in caplog.records)


async def test_the_bound_rolls_a_long_run_back_with_a_503_and_the_retry_runs_under_a_lease(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """lease_s=1: the bound is 1 s. A run of 2.5 s is cut off at it: rolled back, a 503
    too-long with Retry-After: 1; the same request again runs on the two-commit path, where
    it may take as long as it needs (heartbeated), as attempt 2."""
    asgi = create_test_api(orders_db, one_transaction=True, lease_s=1.0)
    async with serving(asgi) as base, client_of(base) as client:
        started = time.monotonic()
        cut = await post(client, "b-1", {}, "/slow", params={"s": 2.5})
        elapsed = time.monotonic() - started
        assert await db.fetchval("SELECT count(*) FROM orders") == 0
        retry = await post(client, "b-1", {}, "/slow", params={"s": 2.5})
    assert cut.status_code == 503, cut.text
    assert cut.headers["retry-after"] == "1"
    assert cut.json()["type"] == "urn:dedupe-worker:problem:too-long"
    assert elapsed < 2.0
    assert retry.status_code == 201, retry.text
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
    assert await claim_row(db, "b-1") == {
        "status": "completed",
        "attempts": 2,
        "error": None,
        "lapsed": None,
    }


# -- publishes and steps -------------------------------------------------------------------


async def test_publishes_commit_with_the_response_and_never_on_a_5xx(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    first = await post(api, "o-1", {}, "/notify", params={"step": "false"})
    again = await post(api, "o-1", {}, "/notify", params={"step": "false"})
    alone = await post(api, "o-2", {}, "/notify", params={"step": "false", "write": "false"})
    failed = await post(api, "o-3", {}, "/notify", params={"step": "false", "fail": "true"})
    assert first.status_code == again.status_code == alone.status_code == 201
    assert failed.status_code == 503
    rows = await db.fetch("SELECT message_id, xmin::text AS xmin FROM dedupe_outbox ORDER BY id")
    assert [r["message_id"] for r in rows] == [
        first.json()["message_id"],
        alone.json()["message_id"],
    ]
    # The outbox row, the order and the completed claim: one transaction.
    order_xmin = await db.fetchval("SELECT xmin::text FROM orders WHERE idempotency_key = 'o-1'")
    claim_xmin = await db.fetchval("SELECT xmin::text FROM dedupe_claims WHERE key = 'o-1'")
    assert rows[0]["xmin"] == order_xmin == claim_xmin
    assert await db.fetchval("SELECT count(*) FROM orders") == 1


async def test_a_step_fails_the_attempt_and_the_retry_runs_it_on_two_commits(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """A step needs its own commit: in one transaction it raises before its function runs;
    the attempt rolls back (a 500 from the framework) and the retry, on the two-commit path,
    records the step and answers."""
    failed = await post(api, "s-1", {}, "/notify")
    assert failed.status_code == 500
    assert await db.fetchval("SELECT count(*) FROM dedupe_steps") == 0
    retry = await post(api, "s-1", {}, "/notify")
    assert retry.status_code == 201, retry.text
    assert retry.json()["checked"] == {"ok": True}
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 1
    assert await db.fetchval("SELECT count(*) FROM orders") == 1


def test_one_transaction_and_wait_s_exclude_each_other(orders_db: str) -> None:
    with pytest.raises(ConfigurationError, match="wait_s"):
        create_test_api(orders_db, one_transaction=True, wait_s=5).build_middleware_stack()


async def test_a_predicate_chooses_the_requests_that_take_one_transaction(
    orders_db: str, db: asyncpg.Connection
) -> None:
    """one_transaction=(method, path) -> bool: /orders in one transaction, /slow on two (its
    claim is committed while it runs)."""
    asgi = create_test_api(orders_db, one_transaction=lambda method, path: path == "/orders")
    async with serving(asgi) as base, client_of(base) as client:
        one = asyncio.ensure_future(post(client, "p-1", {}, "/slow", params={"s": 0.5}))
        await eventually(lambda: db.fetchval("SELECT count(*) FROM dedupe_claims"))  # committed
        assert (await one).status_code == 201
        assert (await post(client, "p-2", {"sku": "a"})).status_code == 201
    assert await db.fetchval("SELECT count(*) FROM orders") == 2


# -- crashes: a uvicorn process killed or frozen mid-endpoint --------------------------------

TOKEN = {"Authorization": "Bearer one-transaction-process"}


class Api(ApiProcesses):
    """The test API's processes in one-transaction mode."""

    def __init__(self, db_url: str, logs: Path, lease_s: float) -> None:
        super().__init__(db_url, logs, lease_s=lease_s, env={"HTTP_API_ONE_TRANSACTION": "1"})


@contextlib.contextmanager
def process_api(db_url: str, logs: Path, lease_s: float) -> Iterator[Api]:
    api = Api(db_url, logs, lease_s)
    try:
        yield api
    finally:
        api.close()


async def send(api: Api, key: str, pause_s: float | None, *, timeout_s: float = 30) -> Any:
    """POST /slow?s=0 (X-Pause-S: pause_s when given; headers are not fingerprinted)."""
    headers = {**TOKEN, "Idempotency-Key": key}
    if pause_s is not None:
        headers["X-Pause-S"] = str(pause_s)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            return await client.post(
                f"{api.base}/slow", params={"s": "0"}, json={"sku": "crash"}, headers=headers
            )
        except httpx.HTTPError as exc:
            return exc


async def test_a_kill_9_mid_endpoint_leaves_no_claim_and_the_retry_runs_at_once(
    orders_db: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    """SIGKILL while the endpoint's order is written and not committed: PostgreSQL rolls the
    transaction back as the connection drops, claim included. The retry needs no lease to
    lapse: it runs at once, once, as a new key."""
    with process_api(orders_db, tmp_path, lease_s=30) as api:
        victim = await asyncio.to_thread(api.start)
        killed = asyncio.ensure_future(send(api, "k-1", pause_s=30))
        await eventually(lambda: open_transactions(db), timeout_s=20)
        await asyncio.sleep(0.3)  # the order is inserted (uncommitted) by now
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
        assert isinstance(await killed, httpx.HTTPError)
        await eventually(lambda: _no_open(db), timeout_s=10)
        assert await db.fetchval("SELECT count(*) FROM dedupe_claims") == 0
        assert await db.fetchval("SELECT count(*) FROM orders") == 0
        await asyncio.to_thread(api.start)
        retry = await send(api, "k-1", pause_s=None)
        replay = await send(api, "k-1", pause_s=None)
    assert retry.status_code == 201, retry.text
    assert replay.content == retry.content and replay.headers["idempotent-replayed"] == "true"
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
    assert await claim_row(db, "k-1") == {
        "status": "completed",
        "attempts": 1,
        "error": None,
        "lapsed": None,
    }


async def _no_open(db: asyncpg.Connection) -> bool:
    return await open_transactions(db) == 0


async def test_a_frozen_process_holds_the_key_until_its_session_is_ended_and_writes_nothing(
    orders_db: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    """SIGSTOP mid-endpoint (lease 2 s: bound 2 s, sessions ended 3 s idle, lock_timeout
    0.67 s). Meanwhile a retry on another process waits on the row and gets 409; PostgreSQL
    ends the frozen session, the retry runs once; the zombie, resumed, writes nothing."""
    (tmp_path / "other").mkdir()
    with (
        process_api(orders_db, tmp_path, lease_s=2) as api,
        process_api(orders_db, tmp_path / "other", lease_s=2) as other,
    ):
        zombie = await asyncio.to_thread(api.start)
        await asyncio.to_thread(other.start)
        frozen = asyncio.ensure_future(send(api, "z-1", pause_s=1.5, timeout_s=60))
        await eventually(lambda: open_transactions(db), timeout_s=20)
        await asyncio.sleep(0.2)
        zombie.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        held = await send(other, "z-1", pause_s=None)
        assert held.status_code == 409, held.text
        answer = held
        deadline = time.monotonic() + 15
        while answer.status_code == 409 and time.monotonic() < deadline:
            await asyncio.sleep(0.3)
            answer = await send(other, "z-1", pause_s=None)
        assert answer.status_code == 201, answer.text
        assert time.monotonic() - frozen_at > 2.0  # the session ended 3 s after its last statement
        zombie.send_signal(signal.SIGCONT)
        late = await frozen
        replay = await send(other, "z-1", pause_s=None)
    assert isinstance(late, httpx.HTTPError) or late.status_code == 503, late
    assert replay.content == answer.content and replay.headers["idempotent-replayed"] == "true"
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
    assert json.loads(answer.content)["order_id"] == await db.fetchval("SELECT id FROM orders")


# -- the completion and the COMMIT in one round trip ---------------------------------------


async def test_a_response_full_of_quotes_is_stored_and_replayed_byte_for_byte(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """The completion's values go as SQL literals (complete_and_commit): quotes, backslashes,
    dollar quotes, comments and non-ASCII text come back as they went."""
    first = await post(api, "quoted-1", {"sku": "q"}, path="/quoted")
    again = await post(api, "quoted-1", {"sku": "q"}, path="/quoted")
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert "it's \\ \\' '' $$" in first.json()["text"]
    assert again.headers["location"] == first.headers["location"]
    assert first.headers["location"].endswith("?note=it's\\'a''quote")
    assert again.headers.get("idempotent-replayed") == "true"
    assert await db.fetchval("SELECT count(*) FROM orders WHERE sku = 'quoted'") == 1


async def test_a_run_whose_claim_changed_under_it_commits_nothing(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """The fence refuses the completion (the endpoint changed its claim's token): the 409 of a
    key lost to a newer request, and neither the order nor the claim is committed."""
    answer = await post(api, "usurped-1", {"sku": "u"}, path="/usurped")
    assert answer.status_code == 409
    assert "lost its key" in answer.text
    assert await db.fetchval("SELECT count(*) FROM orders WHERE sku = 'usurped'") == 0
    assert await claim_row(db, "usurped-1") is None


async def test_a_run_that_deallocated_the_completions_statement_keeps_nothing_and_its_retry_runs(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """An endpoint that deallocates the prepared completion on its connection: its completion
    fails, a 503 whose retry runs (on two commits, as attempt 2), nothing of the first run kept;
    new keys after it are served (the failed completion deallocated what was left of the
    statements: the next claim on that connection prepares them again). (DEALLOCATE ALL is no
    endpoint's to run: it drops asyncpg's own statements, whose next use on it fails.)"""
    deallocated = "dedupe_http_complete_v1"
    first = await post(
        api, "dealloc-1", {"sku": "d"}, path="/deallocates", headers={"X-Deallocate": deallocated}
    )
    assert first.status_code == 503, first.text
    assert await db.fetchval("SELECT count(*) FROM orders WHERE sku = 'deallocates'") == 0
    retry = await post(api, "dealloc-1", {"sku": "d"}, path="/deallocates")
    assert retry.status_code == 201, retry.text
    assert (await claim_row(db, "dealloc-1") or {}).get("attempts") == 2
    answers = []
    for n in range(4):  # whichever pooled connection each takes
        answers.append((await post(api, f"dealloc-next-{n}", {"sku": "n"})).status_code)
    assert answers == [201] * 4
    assert await db.fetchval("SELECT count(*) FROM orders WHERE sku = 'deallocates'") == 1


# -- an endpoint that ends its transaction itself --------------------------------------------


async def ended(api: httpx.AsyncClient, key: str, end: str, answer: int = 201) -> httpx.Response:
    headers = {"X-End": end, "X-Answer": str(answer)}
    return await post(api, key, {"sku": "e"}, path="/ends-itself", headers=headers)


async def test_an_endpoint_that_calls_commit_gets_a_500_and_keeps_nothing(
    api: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """request.state.idempotency.db.commit() raises in a one-transaction run: the endpoint's
    exception (a 500), everything rolled back; the retry runs as attempt 2."""
    first = await ended(api, "end-1", "commit()")
    assert first.status_code == 500
    assert await db.fetchval("SELECT count(*) FROM orders WHERE sku = 'ends-itself'") == 0
    retry = await ended(api, "end-1", "")
    assert retry.status_code == 201, retry.text
    assert (await claim_row(db, "end-1") or {}).get("attempts") == 2


async def test_an_endpoint_that_sends_commit_has_its_answer_stored_and_replayed(
    api: httpx.AsyncClient, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A COMMIT sent through the endpoint's connection committed its writes and the claim row
    (completed in place, no answer yet): the completion stores the answer after it, in a
    transaction of its own, so the retry is a replay, not a key completed without an answer;
    the misuse is logged as an error."""
    with caplog.at_level(logging.ERROR, logger="dedupe.asgi"):
        first = await ended(api, "end-2", "COMMIT")
    assert first.status_code == 201, first.text
    assert any("do not end its transaction" in r.getMessage() for r in caplog.records)
    again = await ended(api, "end-2", "")
    assert again.status_code == 201 and again.content == first.content
    assert again.headers.get("idempotent-replayed") == "true"
    assert await db.fetchval("SELECT count(*) FROM orders WHERE sku = 'ends-itself'") == 1
    assert (await claim_row(db, "end-2") or {}).get("status") == "completed"


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK"])
async def test_an_endpoint_that_ends_its_transaction_and_fails_leaves_its_key_to_the_retry(
    api: httpx.AsyncClient, db: asyncpg.Connection, end: str
) -> None:
    """A COMMIT or ROLLBACK sent through the endpoint's connection, then a 503: the claim row
    the COMMIT committed (completed in place, no answer) is handed back, as a failed first
    attempt's, so the retry runs as attempt 2 (its order is a second one: the first committed
    on its own, which is why an endpoint must not end its transaction), never a 409 for a key
    completed without an answer."""
    first = await ended(api, f"end-3-{end}", end, answer=503)
    assert first.status_code == 503, first.text
    retry = await ended(api, f"end-3-{end}", "")
    assert retry.status_code == 201, retry.text
    row = await claim_row(db, f"end-3-{end}") or {}
    assert (row.get("status"), row.get("attempts")) == ("completed", 2)
