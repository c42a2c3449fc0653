"""A failure's reason has a column of its own (migration 0010): written beside its detail,
read back without parsing, recorded in the history, and split out of the rows written before."""

from __future__ import annotations

import json

import asyncpg
from pydantic import BaseModel

from dedupe import App
from dedupe.claims.database import migrate
from dedupe.claims.records import ClaimRequest, Fence, Reason
from dedupe.claims.store import ClaimStore
from dedupe.operations.claims import ClaimAdmin
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from dedupe.transport import Action

CH = "work"


class Job(BaseModel):
    n: int


def job(key: str) -> MemoryDelivery:
    return MemoryDelivery(make_message(CH, json.dumps({"n": 1}), message_id=key))


def quiet_app() -> App:
    app = App("t")

    @app.handler(CH)
    async def work(payload: Job) -> None:
        raise AssertionError("a failed key never runs again")

    return app


async def test_a_failure_writes_its_reason_and_detail_apart_and_the_history_keeps_both(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """The claim row and its 'failed' event hold the reason in `reason`, the detail alone."""
    [claim] = await store.claim_batch(
        [ClaimRequest("t.work", "k", b"h")], lease_s=30, retention_s=3600
    )
    fence = Fence("t.work", "k", claim.token or 0)
    assert await store.fail(fence, reason=Reason.REJECTED, detail="card: declined", retention_s=60)
    row = await db.fetchrow("SELECT status, reason, error FROM dedupe_claims")
    assert tuple(row) == ("failed", "rejected", "card: declined")
    shown = await ClaimAdmin(store).show("t.work", "k")
    assert shown is not None
    assert (shown["reason"], shown["error"]) == ("rejected", "card: declined")
    [event] = shown["history"]
    assert (event["event"], event["reason"], event["detail"]) == (
        "failed",
        "rejected",
        "card: declined",
    )
    # A release and a new claim clear the failure's reason with its error.
    await store.release("t.work", "k")
    [again] = await store.claim_batch(
        [ClaimRequest("t.work", "k", b"h")], lease_s=30, retention_s=3600
    )
    assert again.owned
    assert tuple(await db.fetchrow("SELECT reason, error FROM dedupe_claims")) == (None, None)


async def test_a_failure_recorded_without_a_reason_is_dead_lettered_again_with_its_whole_text(
    store: ClaimStore, db: asyncpg.Connection
) -> None:
    """A key an operator (or a worker older than 0010) marked failed with an error and no reason
    is dead-lettered as handler_error with that error, not with its first words cut off."""
    await db.execute(
        "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, error, expires_at)"
        " VALUES ('t.work', 'k', $1, 'failed', 'gone', 'ValueError: boom: again',"
        " now() + interval '1 hour')",
        job("k").message.payload_hash,
    )
    async with Processor(quiet_app(), store) as processor:
        delivery = job("k")
        await processor.process(CH, [delivery])
    outcome = delivery.settlements[-1]
    assert outcome.action is Action.DEAD_LETTER
    assert (outcome.reason, outcome.detail) == (Reason.HANDLER_ERROR, "ValueError: boom: again")


# What a worker before migration 0010 wrote into `error`, and what 0010 makes of it.
BEFORE_AND_AFTER = {
    "handler_error: ValueError: a: b": ("handler_error", "ValueError: a: b"),
    "max_attempts_exceeded: 3 attempts, last: OSError: x": (
        "max_attempts_exceeded",
        "3 attempts, last: OSError: x",
    ),
    "rejected: ": ("rejected", ""),  # a Reject with no reason
    "rejected": (None, "rejected"),  # not the old form: no ': '
    "no_handler: none for 'x'": ("no_handler", "none for 'x'"),
    "key_conflict: another payload": ("key_conflict", "another payload"),
    "missing_key: no header": ("missing_key", "no header"),
    "invalid_key: NUL": ("invalid_key", "NUL"),
    "invalid_payload: not JSON": ("invalid_payload", "not JSON"),
    "ValueError: written by hand": (None, "ValueError: written by hand"),
}


async def test_the_migration_splits_the_old_form_where_it_starts_with_a_known_reason(
    db_url: str,
) -> None:
    """Rows and 'failed' events written as 'reason: detail' get their reason column; any other
    error ('handed back', a retried attempt's error, a text written by hand) is left whole."""
    conn = await asyncpg.connect(db_url)
    try:
        # The test's database is migrated: bring it back to what 0009 left, rows and all.
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        await migrate(db_url, up_to=9)
        old = [*BEFORE_AND_AFTER.items()]
        await conn.executemany(
            "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, error,"
            " expires_at) VALUES ('s', $1, '\\x00', 'failed', 'w', $1, now())",
            [(error,) for error, _ in old],
        )
        await conn.execute(
            "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, error,"
            " expires_at) VALUES ('s', 'handed', '\\x00', 'in_progress', 'w', 'handed back',"
            " now()), ('s', 'clean', '\\x00', 'completed', 'w', NULL, now())"
        )
        await conn.executemany(
            "INSERT INTO dedupe_claim_events (scope, key, event, detail) VALUES ('s', $1, $2, $1)",
            [(error, "failed") for error, _ in old] + [("handler_error: x", "attempt")],
        )

        assert (await migrate(db_url))[0] == "0010_failure_reason"  # and any later ones

        rows = await conn.fetch("SELECT key, reason, error FROM dedupe_claims")
        claims = {row["key"]: (row["reason"], row["error"]) for row in rows}
        assert claims == {
            **BEFORE_AND_AFTER,
            "handed": (None, "handed back"),
            "clean": (None, None),
        }
        rows = await conn.fetch("SELECT key, event, reason, detail FROM dedupe_claim_events")
        events = {(row["key"], row["event"]): (row["reason"], row["detail"]) for row in rows}
        assert events == {
            **{(error, "failed"): after for error, after in BEFORE_AND_AFTER.items()},
            # Only failures carried a reason: an attempt's detail is its error, left alone.
            ("handler_error: x", "attempt"): (None, "handler_error: x"),
        }
    finally:
        await conn.close()
