"""A caller of a shared claim statement that stops waiting (the receiver's or the middleware's
store timeout): what the statement claimed for it is given back, nothing it never sent is
claimed, and a claim of the same key waits for every give-back of it (dedupe.claims.verdicts)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from dedupe.claims.fingerprints import RAW, claim_request
from dedupe.claims.records import ClaimRequest
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import Claims, Ours, Terms
from dedupe.testing.deliveries import make_message

TERMS = Terms(30.0, 3600.0)


def request(key: str) -> ClaimRequest:
    return claim_request("s", key, make_message("c", b"{}", message_id=key), RAW)


@pytest.fixture
async def locked(db_url: str) -> AsyncIterator[asyncpg.transaction.Transaction]:
    """The claims table locked by another transaction until the test rolls it back."""
    conn = await asyncpg.connect(db_url)
    tx = conn.transaction()
    await tx.start()
    await conn.execute("LOCK TABLE dedupe_claims IN ACCESS EXCLUSIVE MODE")
    yield tx
    await conn.close()  # rolls back what the test left open


async def settled(claims: Claims) -> None:
    async with asyncio.timeout(20):
        await asyncio.gather(*claims._undoing)


async def test_a_key_claimed_for_a_caller_that_left_is_given_back_uncounted(
    store: ClaimStore, locked: Any, db: asyncpg.Connection
) -> None:
    claims = Claims(store)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await claims.claim("src", TERMS, [request("k")])
    await locked.rollback()
    await settled(claims)
    row = await db.fetchrow(
        "SELECT status, attempts, error, lease_until <= now() AS free FROM dedupe_claims"
    )
    # Handed back at once, and the attempt the new row's claim counted is taken back: its
    # first run is counted as attempt 1 (Leases.give_back does the same at a stop).
    assert dict(row) == {
        "status": "in_progress",
        "attempts": 0,
        "error": "handed back",
        "free": True,
    }
    [again] = await claims.claim("src", TERMS, [request("k")])
    assert isinstance(again, Ours)


@pytest.mark.parametrize("leavers", [1, 2])
async def test_a_prompt_retry_waits_for_every_give_back_of_its_key(
    leavers: int, store: ClaimStore, locked: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two callers of one key leave (a sender's duplicate, then its retry): the one whose
    claim came back in flight has nothing to give back, yet the next claim still waits for the
    other's give-back, which takes a moment to commit."""
    claims = Claims(store)
    real_give_back = store.give_back

    async def slow_give_back(*args: Any, **kwargs: Any) -> bool:
        await asyncio.sleep(0.5)
        return await real_give_back(*args, **kwargs)

    monkeypatch.setattr(store, "give_back", slow_give_back)
    first = asyncio.create_task(claims.claim("src", TERMS, [request("k")]))
    await asyncio.sleep(0.05)
    other = request("k") if leavers == 2 else request("other")
    second = asyncio.create_task(claims.claim("src", TERMS, [other]))
    await asyncio.sleep(0.3)
    first.cancel()
    second.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    await locked.rollback()
    async with asyncio.timeout(10):
        [retry] = await claims.claim("src", TERMS, [request("k")])
    assert isinstance(retry, Ours), retry
    await settled(claims)


async def test_callers_that_leave_before_their_statement_goes_out_claim_nothing(
    store: ClaimStore, locked: Any, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two statements stuck on the lock carry two callers; fifty more queue behind them and
    all leave: only the two in flight claimed (and gave back), nothing else was sent."""
    claims = Claims(store)
    sent: list[int] = []
    real_claim_batch = store.claim_batch

    async def claim_batch(requests: Any, **kwargs: Any) -> Any:
        sent.append(len(requests))
        return await real_claim_batch(requests, **kwargs)

    monkeypatch.setattr(store, "claim_batch", claim_batch)

    async def with_timeout(key: str) -> Any:
        async with asyncio.timeout(0.5):
            return await claims.claim("src", TERMS, [request(key)])

    tasks = []
    for i in range(2):
        tasks.append(asyncio.create_task(with_timeout(f"k{i}")))
        await asyncio.sleep(0.05)
    tasks += [asyncio.create_task(with_timeout(f"k{i}")) for i in range(2, 52)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, TimeoutError) for r in results), results
    await locked.rollback()
    await settled(claims)
    assert sent == [1, 1]
    assert await db.fetchval("SELECT count(*) FROM dedupe_claims WHERE error = 'handed back'") == 2
