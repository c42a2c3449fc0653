"""Key-level admin through the real CLI: list, show with history, release, purge, status, dlq."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App
from dedupe.claims.store import ClaimStore
from dedupe.observability.activity import Activity
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message
from tests.conftest import ROOT

CLI = [sys.executable, "-m", "dedupe.cli"]


class Job(BaseModel):
    n: int


async def cli(
    db_url: str, *args: str, broker: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEDUPE_DATABASE_URL": db_url}
    if broker:
        env["DEDUPE_BROKER_URL"] = broker
    return await asyncio.to_thread(
        subprocess.run,
        [*CLI, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


@pytest.fixture
async def claims(store: ClaimStore, db: asyncpg.Connection) -> asyncpg.Connection:
    """Two handlers' claims: completed, failed (dead-lettered) and one stuck in progress."""
    app = App("adm")

    @app.handler("jobs", max_attempts=1)
    async def work(job: Job) -> None:
        if job.n < 0:
            raise ValueError("negative")

    @app.handler("mail")
    async def mail(job: Job) -> None:
        pass

    def d(channel: str, key: str, n: int = 1) -> MemoryDelivery:
        return MemoryDelivery(make_message(channel, json.dumps({"n": n}), message_id=key))

    # as `dedupe-worker run` does: duplicates are counted per scope for the status page
    async with (
        Activity(store) as activity,
        Processor(app, store, observers=[activity]) as processor,
    ):
        await processor.process("jobs", [d("jobs", "j-ok"), d("jobs", "j-bad", -1)])
        await processor.process("jobs", [d("jobs", "j-ok")])
        await processor.process("mail", [d("mail", "m-1")])
    await db.execute(
        """INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, lease_until,
                                      claimed_at, expires_at)
           VALUES ('adm.work', 'j-stuck', '\\x00', 'in_progress', 'gone-worker',
                   now() - interval '5 minutes', now() - interval '1 hour',
                   now() + interval '1 day')"""
    )
    await db.execute(
        "UPDATE dedupe_claims SET updated_at = now() - interval '2 days' WHERE key = 'm-1'"
    )
    return db


async def test_claims_list_filters_by_handler_status_and_age(db_url: str, claims: object) -> None:
    """--handler, --status and --older-than-s narrow the list; --json prints rows."""
    listed = await cli(db_url, "claims", "list", "--handler", "adm.work", "--json")
    assert sorted(r["key"] for r in json.loads(listed.stdout)) == ["j-bad", "j-ok", "j-stuck"]
    failed = await cli(db_url, "claims", "list", "--status", "failed")
    assert "j-bad" in failed.stdout and "j-ok" not in failed.stdout
    # The reason, then its detail (ValueError is in the default retry_on: one attempt allowed)
    assert "max_attempts_exceeded  1 attempts, last: ValueError: negative" in failed.stdout
    old = await cli(db_url, "claims", "list", "--older-than-s", "600", "--json")
    assert [r["key"] for r in json.loads(old.stdout)] == ["j-stuck"]


async def test_show_prints_a_claim_with_its_history(db_url: str, claims: object) -> None:
    """A failed, dead-lettered, released key shows each of those events in order."""
    released = await cli(db_url, "claims", "release", "adm.work", "j-bad", "--yes")
    assert released.returncode == 0, released.stderr
    assert "released adm.work/j-bad (was failed)" in released.stdout
    shown = await cli(db_url, "claims", "show", "adm.work", "j-bad")
    claim = json.loads(shown.stdout)
    assert claim["status"] == "failed" and claim["retryable"] is True
    assert [e["event"] for e in claim["history"]] == ["failed", "dead_lettered", "released"]
    why = ("max_attempts_exceeded", "1 attempts, last: ValueError: negative")
    assert (claim["reason"], claim["error"]) == why
    failed = claim["history"][0]
    assert (failed["reason"], failed["detail"]) == why
    text = await cli(db_url, "claims", "show", "adm.work", "j-bad", "--table")
    assert "history:" in text.stdout and "released" in text.stdout
    assert "REASON" in text.stdout and "max_attempts_exceeded" in text.stdout


async def test_a_completed_key_is_never_released(db_url: str, claims: object) -> None:
    refused = await cli(db_url, "claims", "release", "adm.work", "j-ok", "--yes")
    assert refused.returncode == 1
    assert "completed keys are never released" in refused.stderr


async def test_destructive_commands_ask_for_confirmation_unless_yes(
    db_url: str, claims: asyncpg.Connection
) -> None:
    """Without --yes and without a terminal, release, purge and dlq replay do nothing and say
    why."""
    for args in (
        ("claims", "release", "adm.work", "j-stuck"),
        ("claims", "purge", "--older-than-s", "0"),
        ("dlq", "replay", "adm-nothing-here"),
    ):
        done = await cli(db_url, *args)
        assert done.returncode == 1
        assert "pass --yes" in done.stderr
    assert await claims.fetchval("SELECT count(*) FROM dedupe_claims") == 4
    assert await claims.fetchval("SELECT retryable FROM dedupe_claims WHERE key='j-stuck'") is False


async def test_purge_deletes_finished_claims_older_than_the_cut_off(
    db_url: str, claims: asyncpg.Connection
) -> None:
    """Only completed/failed claims untouched for longer than the cut-off go, with their history."""
    purged = await cli(db_url, "claims", "purge", "--older-than-s", "86400", "--yes")
    assert purged.stdout.strip() == "purged 1 claim(s)"
    keys = {r["key"] for r in await claims.fetch("SELECT key FROM dedupe_claims")}
    assert keys == {"j-ok", "j-bad", "j-stuck"}
    everything = await cli(db_url, "claims", "purge", "--older-than-s", "0", "--yes")
    assert everything.stdout.strip() == "purged 2 claim(s)"
    assert await claims.fetchval("SELECT count(*) FROM dedupe_claim_events") == 0
    keys = {r["key"] for r in await claims.fetch("SELECT key FROM dedupe_claims")}
    assert keys == {"j-stuck"}  # in progress: release it first


async def test_status_shows_handlers_stuck_keys_and_recent_trouble(
    db_url: str, claims: object, store: ClaimStore
) -> None:
    activity = Activity(store)
    activity.duplicate("adm.work")
    await activity.flush()
    shown = await cli(db_url, "status", "--json")
    document = json.loads(shown.stdout)
    handlers = {h["handler"]: h for h in document["handlers"]}
    assert handlers["adm.work"] == {
        "handler": "adm.work",
        "in_progress": 1,
        "completed": 1,
        "failed": 1,
        "duplicates": 2,  # one counted by the worker, one added here
        "conflicts": 0,
    }
    assert [s["key"] for s in document["stuck"]] == ["j-stuck"]
    assert {e["event"] for e in document["recent"]} == {"failed", "dead_lettered"}


OUTBOX_ROWS = """
INSERT INTO dedupe_outbox (producer, channel, message_id, body, created_at, attempts,
                           last_error, sent_at, expires_at)
VALUES ('adm.work\x1fa', 'emails', 'e-1', 'x', now() - interval '10 minutes', 3,
        'ConnectionError: refused', NULL, now() + interval '1 day'),
       ('adm.work\x1fb', 'emails', 'e-2', 'x', now(), 0, NULL, NULL, now() + interval '1 day'),
       ('adm.work\x1fc', 'receipts', 'r-1', 'x', now() - interval '2 days', 0, NULL,
        now() - interval '2 days', now() + interval '1 day')
"""


async def test_status_shows_the_outbox_backlog_its_lag_and_the_latest_refusal(
    db_url: str, db: asyncpg.Connection
) -> None:
    """Unsent outbox rows in all and per channel, the oldest one's age (the relay's lag) and
    the broker's latest refusal, in --json and as text; sent rows are not backlog."""
    empty = await cli(db_url, "status")
    assert "outbox: nothing waiting to be relayed" in empty.stdout
    await db.execute(OUTBOX_ROWS)
    shown = await cli(db_url, "status", "--json")
    outbox = json.loads(shown.stdout)["outbox"]
    assert (outbox["unsent"], outbox["refused"]) == (2, 1)
    assert 599 < outbox["oldest_unsent_s"] < 700
    [emails] = outbox["channels"]
    assert (emails["channel"], emails["unsent"], emails["refused"]) == ("emails", 2, 1)
    assert emails["last_error"] == "ConnectionError: refused"
    text = await cli(db_url, "status")
    assert "outbox: 2 unsent, the oldest 6" in text.stdout  # 600-odd seconds
    assert "ConnectionError: refused" in text.stdout


async def test_dlq_list_and_replay_on_kafka(
    db_url: str, kafka_url: str, channel: str, claims: asyncpg.Connection
) -> None:
    """On Kafka, dlq list shows each dead letter's reason, scope and key; dlq replay publishes
    it back to its channel without our headers, releases its failed claim, and marks it
    replayed (a second replay moves nothing, list shows nothing left)."""
    from aiokafka import AIOKafkaConsumer

    import dedupe_kafka as kafka_clients

    headers = {
        "x-dedupe-reason": "handler_error",
        "x-dedupe-detail": "ValueError: negative",
        "x-dedupe-scope": "adm.work",
        "x-dedupe-key": "j-bad",
        "x-trace": "t-7",
    }
    await kafka_clients.publish(kafka_url, f"{channel}.dlq", [(b'{"n": -1}', headers, "j-bad")])
    listed = await cli(db_url, "dlq", "list", channel, "--json", broker=kafka_url)
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["reason"], row["scope"], row["key"]) == ("handler_error", "adm.work", "j-bad")

    replay = await cli(db_url, "dlq", "replay", channel, "--yes", broker=kafka_url)
    assert replay.returncode == 0, replay.stderr
    assert "replayed 1 dead letter(s)" in replay.stdout and "released 1" in replay.stdout
    assert await claims.fetchval("SELECT retryable FROM dedupe_claims WHERE key='j-bad'") is True

    reader = AIOKafkaConsumer(
        channel, bootstrap_servers=kafka_url.removeprefix("kafka://"), auto_offset_reset="earliest"
    )
    await reader.start()
    try:
        batches = await reader.getmany(timeout_ms=10_000)
    finally:
        await reader.stop()
    [record] = [r for records in batches.values() for r in records]
    got = {k: v.decode() for k, v in record.headers}
    assert record.value == b'{"n": -1}'
    assert got == {"message-id": "j-bad", "x-trace": "t-7"}

    again = await cli(db_url, "dlq", "replay", channel, "--yes", broker=kafka_url)
    assert again.returncode == 0 and "replayed 0 dead letter(s)" in again.stdout
    left = await cli(db_url, "dlq", "list", channel, broker=kafka_url)
    assert "nothing left to replay" in left.stdout
