"""dedupe.testing.check_exactly_once: a handler that is exactly once passes every case; one that
keys its external call by a random UUID, or writes outside ctx.db, fails with the table."""

from __future__ import annotations

import uuid

import asyncpg
import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.testing import (
    CASES,
    NotExactlyOnce,
    Recorder,
    TestRun,
    check_exactly_once,
    current_run,
)
from tests.conftest import ADMIN_URL

SCHEMA = "CREATE TABLE charges (payment_id text NOT NULL, amount_cents int NOT NULL)"
BODY = {"payment_id": "pay-1", "amount_cents": 1250}
HEADERS = {"Idempotency-Key": "order-1"}
EFFECTS = "SELECT payment_id, amount_cents FROM charges"


class Charge(BaseModel):
    payment_id: str
    amount_cents: int


def payments_app(recorder: Recorder, *, key_of_call: str = "ctx.key", write: str = "ctx.db") -> App:
    """A payments handler; the options make it non-idempotent in the two usual ways."""
    app = App("shop")

    @app.handler("payments", key="header:Idempotency-Key")
    async def charge(event: Charge, ctx: Context) -> dict[str, str]:
        key = ctx.key if key_of_call == "ctx.key" else str(uuid.uuid4())
        recorder.record(key, amount_cents=event.amount_cents)
        if write == "ctx.db":
            await ctx.db.execute(
                "INSERT INTO charges VALUES ($1, $2)", event.payment_id, event.amount_cents
            )
        else:  # its own connection: committed at once, whatever becomes of the run
            run = current_run()
            assert run is not None
            conn = await asyncpg.connect(run.database_url)
            try:
                await conn.execute(
                    "INSERT INTO charges VALUES ($1, $2)", event.payment_id, event.amount_cents
                )
            finally:
                await conn.close()
        return {"charge": f"ch_{key}"}

    return app


async def check(app: App, recorder: Recorder) -> str:
    report = await check_exactly_once(
        app,
        "payments",
        BODY,
        headers=HEADERS,
        database_url=ADMIN_URL,
        schema=SCHEMA,
        effects=EFFECTS,
        external=recorder,
    )
    return str(report)


async def test_an_idempotent_handler_passes_every_case_and_the_report_shows_each() -> None:
    """ctx.db writes and a call keyed by ctx.key: one row and one key in every case."""
    recorder = Recorder()
    report = await check_exactly_once(
        payments_app(recorder),
        "payments",
        BODY,
        headers=HEADERS,
        database_url=ADMIN_URL,
        schema=SCHEMA,
        effects=EFFECTS,
        external=recorder,
    )
    assert report.ok
    assert [r.case.name for r in report.results] == [case.name for case in CASES]
    by_name = {r.case.name: r for r in report.results}
    assert all(r.rows == [("pay-1", 1250)] for r in report.results)
    assert all({c.key for c in r.calls} == {"order-1"} for r in report.results)
    # Runs repeat where a run died or was taken over; the external call with them.
    assert [r.worker for r in by_name["crash after handler"].runs] == ["a", "b"]
    assert len(by_name["crash after handler"].calls) == 2
    assert [r.worker for r in by_name["zombie"].runs] == ["a", "b"]
    assert [r.worker for r in by_name["duplicate at once"].runs] == ["a"]
    text = str(report)
    assert text.startswith("exactly-once check of app 'shop', channel 'payments' (charge)")
    assert "key 'order-1'" in text.splitlines()[0]
    assert "all ok" in text.splitlines()[0]


async def test_an_external_call_keyed_by_a_random_uuid_fails_with_the_table() -> None:
    """A new key on every run: the crash after the handler and the zombie show two keys."""
    recorder = Recorder()
    with pytest.raises(NotExactlyOnce) as raised:
        await check(payments_app(recorder, key_of_call="uuid4"), recorder)
    text = str(raised.value)
    print(text)  # the table, for whoever reads the test's output
    failed = {r.case.name for r in raised.value.report.failed}
    assert failed == {"crash after handler", "zombie"}
    assert "2 of 9 cases FAILED" in text
    assert "external calls with 2 different keys where a single delivery used 1" in text
    assert "likely cause: an external call keyed by something not derived from ctx.key" in text
    assert isinstance(raised.value, AssertionError)
    # No ctx.step: the crash after a step is never reached, and the table says so.
    assert " n/a" in text and "n/a: crash after step: never reached" in text


async def test_an_insert_outside_ctx_db_fails_with_the_table() -> None:
    """A write on its own connection survives the crash: two rows where one delivery left one."""
    recorder = Recorder()
    with pytest.raises(NotExactlyOnce) as raised:
        await check(payments_app(recorder, write="own connection"), recorder)
    text = str(raised.value)
    print(text)
    failed = {r.case.name for r in raised.value.report.failed}
    assert failed == {"crash after handler", "zombie"}
    assert "2 effect rows where a single delivery left 1" in text
    assert "(not left by a single delivery: ('pay-1', 1250))" in text
    assert "rows: ('pay-1', 1250), ('pay-1', 1250)" in text
    assert "likely cause: a write outside ctx.db" in text


def adding_app(recorder: Recorder) -> App:
    """Adds the amount to a balance on its own connection (an upsert): one row either way, but
    a run that died has added it already when its retry adds it again."""
    app = App("shop")

    @app.handler("payments", key="header:Idempotency-Key")
    async def charge(event: Charge, ctx: Context) -> str:
        recorder.record(ctx.key, amount_cents=event.amount_cents)
        run = current_run()
        assert run is not None
        conn = await asyncpg.connect(run.database_url)
        try:
            await conn.execute(
                "INSERT INTO balances VALUES ($1, $2) ON CONFLICT (payment_id)"
                " DO UPDATE SET amount_cents = balances.amount_cents + excluded.amount_cents",
                event.payment_id,
                event.amount_cents,
            )
        finally:
            await conn.close()
        return "charged"

    return app


async def test_effects_are_compared_by_content_not_by_their_number() -> None:
    """As many rows as a single delivery left, but other values: the case fails and shows the
    rows that differ (row counts alone passed this handler)."""
    recorder = Recorder()
    with pytest.raises(NotExactlyOnce) as raised:
        await check_exactly_once(
            adding_app(recorder),
            "payments",
            BODY,
            headers=HEADERS,
            database_url=ADMIN_URL,
            schema="CREATE TABLE balances (payment_id text PRIMARY KEY, amount_cents int)",
            effects="SELECT payment_id, amount_cents FROM balances",
            external=recorder,
        )
    text = str(raised.value)
    print(text)
    assert {r.case.name for r in raised.value.report.failed} == {"crash after handler", "zombie"}
    assert (
        "1 effect rows as a single delivery left, but not the same (not left by a single"
        " delivery: ('pay-1', 2500); missing: ('pay-1', 1250))"
    ) in text
    assert "likely cause: a write outside ctx.db" in text


async def test_a_message_the_handler_does_not_complete_is_refused_by_the_check() -> None:
    """Without its Idempotency-Key the message is dead-lettered: the check says so at once."""
    recorder = Recorder()
    with pytest.raises(AssertionError, match=r"was not acked \(dead-lettered \(missing_key\)\)"):
        await check_exactly_once(
            payments_app(recorder),
            "payments",
            BODY,
            database_url=ADMIN_URL,
            schema=SCHEMA,
            effects=EFFECTS,
            external=recorder,
        )


async def test_effects_may_be_read_by_a_callable_given_the_run() -> None:
    """effects= a coroutine function of the TestRun: its rows are compared as a query's are."""
    recorder = Recorder()

    async def charges(run: TestRun) -> list[tuple[str, int]]:
        rows = await run.fetch("SELECT payment_id, amount_cents FROM charges")
        return [(row["payment_id"], row["amount_cents"]) for row in rows]

    report = await check_exactly_once(
        payments_app(recorder),
        "payments",
        BODY,
        headers=HEADERS,
        database_url=ADMIN_URL,
        schema=SCHEMA,
        effects=charges,
    )
    assert report.ok and report.results[0].rows == [("pay-1", 1250)]
    assert all(r.calls == [] for r in report.results)  # no Recorder given: none compared
