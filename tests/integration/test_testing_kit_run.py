"""dedupe.testing.TestRun: the same App on an in-memory broker with the real claim protocol on a
throwaway database; publishing with headers, duplicates on demand, and what can be inspected."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context, Message, Reject
from dedupe.claims.records import Reason
from dedupe.testing import Recorder, TestRun, current_run
from tests.conftest import ADMIN_URL

SCHEMA = "CREATE TABLE charges (payment_id text NOT NULL, amount_cents int NOT NULL)"


class Charge(BaseModel):
    payment_id: str
    amount_cents: int


def charging_app(calls: list[str], *, delay_s: float = 0.0) -> App:
    app = App("kit")

    @app.handler("payments", key="header:Idempotency-Key", lease_s=30)
    async def charge(event: Charge, ctx: Context) -> dict[str, str]:
        calls.append(ctx.key)
        await asyncio.sleep(delay_s)
        if event.amount_cents <= 0:
            raise Reject("amount must be positive")
        await ctx.db.execute(
            "INSERT INTO charges VALUES ($1, $2)", event.payment_id, event.amount_cents
        )
        return {"charged": event.payment_id}

    return app


def charge(payment_id: str = "p-1", amount_cents: int = 100) -> dict[str, object]:
    return {"payment_id": payment_id, "amount_cents": amount_cents}


async def test_a_published_message_is_run_acked_and_its_result_and_claim_can_be_read() -> None:
    """Publish with a header, wait until idle: one run, one ack, the stored result, the claim."""
    calls: list[str] = []
    async with TestRun(charging_app(calls), database_url=ADMIN_URL, schema=SCHEMA) as run:
        sent = run.publish("payments", charge(), headers={"idempotency-key": "k-1"})
        await run.idle()
        assert calls == ["k-1"]
        assert [s.fate for s in run.acked] == ["acked"]
        assert sent.outcome is not None and sent.outcome.result == {"charged": "p-1"}
        assert await run.result("k-1") == {"charged": "p-1"}
        [claim] = await run.claims()
        assert (claim.scope, claim.status, claim.owner) == ("kit.charge", "completed", "worker-a")
        assert await run.fetchval("SELECT count(*) FROM charges") == 1


async def test_every_run_gets_a_fresh_database_with_the_schema_and_drops_it_at_the_end() -> None:
    """Two runs in turn each start empty; the database is gone once the block is left."""
    app = charging_app([])
    async with TestRun(app, database_url=ADMIN_URL, schema=SCHEMA) as first:
        first.publish("payments", charge(), headers={"Idempotency-Key": "k"})
        await first.idle()
        url = first.database_url
    async with TestRun(app, database_url=ADMIN_URL, schema=SCHEMA) as second:
        assert second.database_url != url
        assert await second.fetchval("SELECT count(*) FROM charges") == 0
        assert await second.claims() == []
    admin = await asyncpg.connect(ADMIN_URL)
    try:
        name = url.rsplit("/", 1)[1]
        assert not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
    finally:
        await admin.close()


async def test_concurrent_copies_later_copies_and_a_lost_ack_run_the_handler_once() -> None:
    """Two copies at once, a copy after a delay, a lost ack: one run per key, every copy acked."""
    calls: list[str] = []
    async with TestRun(
        charging_app(calls, delay_s=0.1), database_url=ADMIN_URL, schema=SCHEMA
    ) as run:
        at_once = run.publish("payments", charge("a"), headers={"Idempotency-Key": "a"}, copies=2)
        later = run.publish(
            "payments", charge("b"), headers={"Idempotency-Key": "b"}, copies=2, delay_s=0.3
        )
        lost = run.publish("payments", charge("c"), headers={"Idempotency-Key": "c"}, lose_ack=True)
        await run.idle()
        assert sorted(calls) == ["a", "b", "c"]
        assert [s.fate for s in at_once.log].count("acked") == 2
        assert [s.duplicate for s in later.log if s.fate == "acked"] == [False, True]
        assert [s.fate for s in lost.log] == ["ack_lost", "acked"]
        assert await run.fetchval("SELECT count(*) FROM charges") == 3


async def test_a_redelivered_message_is_acked_as_a_duplicate_with_its_stored_result() -> None:
    """redeliver() sends the same id, body and headers again, now or later; no run again."""
    calls: list[str] = []
    async with TestRun(charging_app(calls), database_url=ADMIN_URL, schema=SCHEMA) as run:
        sent = run.publish("payments", charge(), headers={"Idempotency-Key": "k"})
        await run.idle()
        again = run.redeliver(sent)
        await run.idle()
        later = run.redeliver(sent, delay_s=0.3)
        await asyncio.sleep(0.1)
        assert later.deliveries == 0 and not run.quiet  # not delivered yet, but outstanding
        await run.idle()
        assert later.deliveries == 1 and later.outcome is not None and later.outcome.duplicate
    assert calls == ["k"]
    assert again.outcome is not None and again.outcome.duplicate
    assert again.outcome.result == {"charged": "p-1"}


async def test_dead_letters_carry_their_reason_detail_and_headers() -> None:
    """A rejected payment, a missing key and a key reused with another body are dead letters."""
    async with TestRun(charging_app([]), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.publish("payments", charge(amount_cents=0), headers={"Idempotency-Key": "zero"})
        run.publish("payments", charge())  # no Idempotency-Key
        run.publish("payments", charge("x"), headers={"Idempotency-Key": "k"})
        await run.idle()
        run.publish("payments", charge("y"), headers={"Idempotency-Key": "k"})
        await run.idle()
        reasons = sorted(str(d.reason) for d in run.dead_letters)
        assert reasons == ["key_conflict", "missing_key", "rejected"]
        [rejected] = [d for d in run.dead_letters if d.reason is Reason.REJECTED]
        assert rejected.detail == "amount must be positive"
        assert rejected.headers["x-dedupe-reason"] == "rejected"
        with pytest.raises(LookupError, match="failed"):
            await run.result("zero")


async def test_the_apps_own_hooks_run_and_the_kits_hook_is_gone_afterwards() -> None:
    """The same App object runs, its hooks included; the run leaves app.hooks as it found it."""
    stages: list[str] = []
    app = charging_app([])

    @app.hook("claimed", "handled", "completed")
    async def record(stage: str, message: Message, scope: str, key: str) -> None:
        stages.append(stage)

    before = list(app.hooks)
    async with TestRun(app, database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.publish("payments", charge(), headers={"Idempotency-Key": "k"})
        await run.idle()
    assert stages == ["claimed", "handled", "completed"]
    assert app.hooks == before


async def test_a_fake_client_finds_the_run_and_the_recorder_the_worker_that_called() -> None:
    """current_run() inside a handler is the TestRun; Recorder notes the worker of each call."""
    recorder = Recorder()
    seen: list[str] = []
    app = App("kit")

    @app.handler("mail")
    async def send(message: Message) -> None:
        run = current_run()
        assert run is not None
        seen.append(run.database_url)
        recorder.record(message.message_id, to="a@example.com")

    async with TestRun(app, database_url=ADMIN_URL) as run:
        run.publish("mail", b"{}", message_id="mail-1")
        await run.idle()
        assert seen == [run.database_url]
    [call] = recorder.calls
    assert (call.key, call.worker, dict(call.what)) == ("mail-1", "a", {"to": "a@example.com"})
    assert current_run() is None


async def test_publishing_to_a_channel_no_handler_consumes_says_which_channels_there_are() -> None:
    """A typo in the channel fails at once instead of waiting for idle() to time out."""
    async with TestRun(charging_app([]), database_url=ADMIN_URL, schema=SCHEMA) as run:
        with pytest.raises(ValueError, match="its channels: payments"):
            run.publish("payment", charge())


async def test_idle_says_what_is_left_when_a_message_does_not_settle_in_time() -> None:
    """A handler that outlives the timeout: idle() fails with the message and the busy worker."""
    async with TestRun(charging_app([], delay_s=2), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.publish("payments", charge(), headers={"Idempotency-Key": "slow"}, message_id="m-slow")
        with pytest.raises(AssertionError, match=r"(?s)not idle after 0.3s.*'m-slow'.*worker a"):
            await run.idle(timeout_s=0.3)
