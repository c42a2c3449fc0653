"""ClaimStore._fetch: a statement of its own is sent again after a transient error, up to
FETCH_ATTEMPTS times, on tenacity's backoff; any other error goes out at once. The pool here
is a stand-in that fails as told: what is tested is the loop, not PostgreSQL (the integration
and chaos suites terminate real backends)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from dedupe.claims import store as store_module
from dedupe.claims.store import FETCH_ATTEMPTS, ClaimStore, ValueRefused, fetch_backoff
from dedupe.errors import StoreError


class _Connection:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.sent = 0
        self.settings: list[str] = []

    async def fetch(self, query: str, *args: Any) -> list[Any]:
        self.sent += 1
        if self.failures:
            raise self.failures.pop(0)
        return [("row", args)]

    async def execute(self, query: str) -> None:
        self.settings.append(query)

    @asynccontextmanager
    async def transaction(self) -> Any:
        yield

    def mark_clean(self) -> None:
        pass


class _Pool:
    def __init__(self, failures: list[BaseException]) -> None:
        self.connection = _Connection(failures)
        self.acquired = 0
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    @asynccontextmanager
    async def acquire(self) -> Any:
        self.acquired += 1
        yield self.connection


@pytest.fixture(autouse=True)
def _no_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waits: list[float] = []

    async def sleep(delay: float) -> None:
        waits.append(delay)

    monkeypatch.setattr(store_module.asyncio, "sleep", sleep)
    return waits


def _store(failures: list[BaseException]) -> tuple[ClaimStore, _Pool]:
    pool = _Pool(failures)
    return ClaimStore(pool, owner="test"), pool  # type: ignore[arg-type]


async def test_a_transient_error_sends_the_statement_again_on_another_connection(
    _no_waits: list[float],
) -> None:
    store, pool = _store([ConnectionResetError("gone"), asyncpg.InterfaceError("closed")])
    rows = await store._fetch("show_claim", "scope", "key")
    assert rows == [("row", ("scope", "key"))]
    assert pool.acquired == 3
    assert len(_no_waits) == 2
    assert all(0 < wait <= 1.0 for wait in _no_waits)


async def test_after_the_last_attempt_a_transient_error_is_a_store_error(
    _no_waits: list[float],
) -> None:
    store, pool = _store([ConnectionResetError("gone")] * (FETCH_ATTEMPTS + 1))
    with pytest.raises(StoreError, match="show_claim failed: ConnectionResetError"):
        await store._fetch("show_claim", "scope", "key")
    assert pool.connection.sent == FETCH_ATTEMPTS
    assert len(_no_waits) == FETCH_ATTEMPTS - 1


async def test_a_closed_pool_is_not_tried_again(_no_waits: list[float]) -> None:
    """A stop that dropped the pool past its bound: each give-back after it fails at once
    instead of waiting out the backoff (4 attempts, ~0.4 s each, one give-back after another,
    held a stalled worker's stop past its bound)."""
    store, pool = _store([asyncpg.InterfaceError("pool is closed")] * FETCH_ATTEMPTS)
    pool.closing = True
    with pytest.raises(StoreError, match="pool is closed"):
        await store._fetch("show_claim", "scope", "key")
    assert pool.connection.sent == 1
    assert _no_waits == []


async def test_a_refused_value_and_a_lock_timeout_are_not_sent_again() -> None:
    store, pool = _store([asyncpg.DataError("invalid byte sequence")])
    with pytest.raises(ValueRefused):
        await store._fetch("show_claim", "scope", "key")
    assert pool.connection.sent == 1

    store, pool = _store([asyncpg.LockNotAvailableError("lock timeout")])
    with pytest.raises(asyncpg.LockNotAvailableError):
        await store._fetch("show_claim", "scope", "key", bounded="SET LOCAL lock_timeout = 1")
    assert pool.connection.sent == 1
    assert pool.connection.settings == ["SET LOCAL lock_timeout = 1"]


def test_the_backoff_grows_exponentially_with_jitter_up_to_a_second() -> None:
    for failed, low in ((1, 0.05), (2, 0.1), (3, 0.2)):
        waits = [fetch_backoff(failed) for _ in range(50)]
        assert all(low <= wait <= low + 0.05 for wait in waits)
    assert fetch_backoff(30) == 1.0
