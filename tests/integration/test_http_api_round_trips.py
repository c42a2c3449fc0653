"""Which requests of IdempotencyMiddleware(one_transaction=True) send their completion and the
COMMIT in one round trip (ClaimTransaction.complete_and_commit): a run that published nothing;
a run with publishes stores its outbox rows on the way it always did. In-process, on a real
PostgreSQL (bench.http_core's driver, as uvicorn calls the app)."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from bench import http_core
from dedupe.asgi import one_transaction
from tests.apps.http_api import create_test_api
from tests.in_process import post


async def test_only_a_run_without_publishes_commits_in_the_completions_round_trip(
    orders_db: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    original = one_transaction.ClaimTransaction.complete_and_commit

    async def counted(self: one_transaction.ClaimTransaction, completion: Any) -> bool:
        calls.append(completion.fence.key)
        return await original(self, completion)

    monkeypatch.setattr(one_transaction.ClaimTransaction, "complete_and_commit", counted)
    monkeypatch.setattr(one_transaction, "READ_FIRST_SHARE", 2.0)  # the claim straight away
    app = create_test_api(orders_db, one_transaction=True)
    plain, published = f"plain-{uuid.uuid4().hex}", f"published-{uuid.uuid4().hex}"
    async with http_core.Lifespan(app) as life:
        assert await post(app, life.state, plain, "/orders") == 201
        assert await post(app, life.state, published, "/notify?step=false") == 201
        assert await post(app, life.state, plain, "/orders") == 201  # a replay: no run
    assert calls == [plain]
    stored = await db.fetch("SELECT key, status FROM dedupe_claims ORDER BY key")
    assert [(r["key"], r["status"]) for r in stored] == sorted(
        [(plain, "completed"), (published, "completed")]
    )
    assert await db.fetchval("SELECT count(*) FROM dedupe_outbox") == 1
