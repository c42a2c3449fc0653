"""dedupe.testing sees a handler's publishes and steps: ctx.publish is relayed to the in-memory
broker (a two-stage chain runs in one TestRun), a worker may die between a step's call and its
record, and the memory broker marks first deliveries as RabbitMQ does, so one_transaction=True
handlers take their one-transaction path under the kit."""

from __future__ import annotations

import uuid

import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.testing import NotExactlyOnce, Recorder, TestRun, check_exactly_once
from tests.conftest import ADMIN_URL

SCHEMA = """
CREATE TABLE shipments (order_id text NOT NULL, parcel text NOT NULL);
CREATE TABLE charges (payment_id text NOT NULL, amount_cents int NOT NULL);
"""


class Order(BaseModel):
    order_id: str


class Charge(BaseModel):
    payment_id: str
    amount_cents: int


def chain_app(seen: list[dict[str, str]]) -> App:
    """Stage 1 publishes a shipment (and an e-mail nobody here consumes); stage 2 ships it."""
    app = App("chain")

    @app.handler("orders")
    async def accept(order: Order, ctx: Context) -> str:
        await ctx.publish("shipments", {"order_id": order.order_id, "parcel": "box-1"})
        await ctx.publish("emails", {"to": "someone@example.com"})
        return "accepted"

    @app.handler("shipments")
    async def ship(shipment: dict[str, str], ctx: Context) -> str:
        seen.append({"key": ctx.key, **shipment})
        await ctx.db.execute(
            "INSERT INTO shipments VALUES ($1, $2)", shipment["order_id"], shipment["parcel"]
        )
        return "shipped"

    return app


async def test_a_publish_of_stage_one_is_handled_by_stage_two_in_the_same_run() -> None:
    """ctx.publish goes through the outbox and its relay to the memory broker: idle() waits for
    the next stage too; a channel the app does not consume keeps its messages in `published`."""
    seen: list[dict[str, str]] = []
    async with TestRun(chain_app(seen), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.publish("orders", {"order_id": "o-1"}, message_id="order-1")
        await run.idle(timeout_s=20)
        assert await run.fetch("SELECT order_id, parcel FROM shipments") == [("o-1", "box-1")]
        [shipment] = run.published_to("shipments")
        assert seen == [{"key": shipment.message_id, "order_id": "o-1", "parcel": "box-1"}]
        [email] = run.published_to("emails")  # kept, delivered to no one, not outstanding
        assert email.body == b'{"to":"someone@example.com"}'
        assert [m.channel for m in run.published] == ["shipments", "emails"]
        assert await run.unsent() == 0
        assert sorted(s.channel for s in run.acked) == ["orders", "shipments"]


async def test_a_stage_one_that_dies_after_its_commit_publishes_once_downstream() -> None:
    """Killed after the commit, before the ack: the redelivery is a duplicate and publishes
    nothing more; stage 2 runs once."""
    seen: list[dict[str, str]] = []
    async with TestRun(chain_app(seen), database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.crash_at("completed", key="order-1")
        run.publish("orders", {"order_id": "o-1"}, message_id="order-1")
        await run.idle(timeout_s=20)
        assert [w.name for w in run.workers] == ["a", "b"]
        assert len(seen) == 1
        assert await run.fetchval("SELECT count(*) FROM shipments") == 1
        assert len({m.message_id for m in run.published_to("shipments")}) == 1


def stepping_app(recorder: Recorder, *, key_of_call: str) -> App:
    """A payment through ctx.step; the provider's key is ctx.key's, or a new uuid4 per call."""
    app = App("steps")

    @app.handler("payments", key="header:Idempotency-Key")
    async def pay(event: Charge, ctx: Context) -> dict[str, str]:
        async def charge_card() -> str:
            key = f"{ctx.key}/charge" if key_of_call == "ctx.key" else str(uuid.uuid4())
            recorder.record(key, amount_cents=event.amount_cents)
            return f"ch_{key}"

        charge_id = await ctx.step("charge", charge_card)
        await ctx.db.execute(
            "INSERT INTO charges VALUES ($1, $2)", event.payment_id, event.amount_cents
        )
        return {"charge": charge_id}

    return app


async def test_a_crash_between_a_steps_call_and_its_record_calls_it_again() -> None:
    """crash_at("stepped"): the step's function ran on worker a, its record never committed;
    worker b calls it again, with the same key when it is derived from ctx.key."""
    recorder = Recorder()
    app = stepping_app(recorder, key_of_call="ctx.key")
    async with TestRun(app, database_url=ADMIN_URL, schema=SCHEMA) as run:
        run.crash_at("stepped")
        run.publish(
            "payments", {"payment_id": "p-1", "amount_cents": 5}, headers={"Idempotency-Key": "k"}
        )
        await run.idle(timeout_s=20)
        assert [(c.key, c.worker) for c in recorder.calls] == [("k/charge", "a"), ("k/charge", "b")]
        assert await run.result("k") == {"charge": "ch_k/charge"}
        assert await run.fetchval("SELECT count(*) FROM charges") == 1
        assert run.armed == []
    # The app's handlers are as registered again once the run is over.
    assert app.handlers["pay"].fn.__name__ == "pay"
    assert not hasattr(app.handlers["pay"].fn, "__wrapped__")


async def check_steps(recorder: Recorder, key_of_call: str) -> str:
    report = await check_exactly_once(
        stepping_app(recorder, key_of_call=key_of_call),
        "payments",
        {"payment_id": "p-1", "amount_cents": 5},
        headers={"Idempotency-Key": "k"},
        database_url=ADMIN_URL,
        schema=SCHEMA,
        effects="SELECT payment_id, amount_cents FROM charges",
        external=recorder,
    )
    return str(report)


async def test_a_step_keyed_by_a_random_uuid_fails_the_check_at_the_crash_after_the_step() -> None:
    """The step's record saves it from every other case; the crash between its call and its
    record repeats the call with a new key, and the table names that as the likely cause."""
    recorder = Recorder()
    with pytest.raises(NotExactlyOnce) as raised:
        await check_steps(recorder, "uuid4")
    text = str(raised.value)
    print(text)
    assert {r.case.name for r in raised.value.report.failed} == {"crash after step"}
    assert "1 of 9 cases FAILED" in text
    assert "likely cause: a ctx.step whose function is not idempotent on retry" in text


async def test_a_step_keyed_by_ctx_key_passes_every_case() -> None:
    recorder = Recorder()
    text = await check_steps(recorder, "ctx.key")
    assert "all ok" in text.splitlines()[0]
    assert "n/a" not in text  # the step's crash point was reached


def one_transaction_app(attempts: list[int]) -> App:
    app = App("onetx")

    @app.handler("payments", key="header:Idempotency-Key", one_transaction=True)
    async def pay(event: Charge, ctx: Context) -> str:
        attempts.append(ctx.message.attempt)
        await ctx.db.execute(
            "INSERT INTO charges VALUES ($1, $2)", event.payment_id, event.amount_cents
        )
        return "paid"

    return app


async def test_first_deliveries_are_marked_so_one_transaction_handlers_take_that_path() -> None:
    """meta["redelivered"] is False on a copy's first delivery and True after (the attempt
    counts); a one_transaction=True handler's first delivery commits in one transaction, and
    the redelivery after a crash takes the two-commit path, as with RabbitMQ."""
    attempts: list[int] = []
    body = {"payment_id": "p-1", "amount_cents": 5}
    async with TestRun(one_transaction_app(attempts), database_url=ADMIN_URL, schema=SCHEMA) as run:
        first = run.publish("payments", body, headers={"Idempotency-Key": "k-1"})
        await run.idle(timeout_s=20)
        assert first.message.meta["redelivered"] is False
        assert run.worker.stats.one_transaction == 1
        assert run.worker.stats.one_transaction_fallbacks == {}

        run.crash_at("handled", key="k-2")
        second = run.publish("payments", body, headers={"Idempotency-Key": "k-2"})
        await run.idle(timeout_s=20)
        deliveries = [s.message for s in second.log]
        assert [(m.attempt, m.meta["redelivered"]) for m in deliveries] == [(2, True)]
        assert attempts == [1, 1, 2]
        assert run.worker.stats.one_transaction_fallbacks["redelivery"] == 1
        assert await run.fetchval("SELECT count(*) FROM charges") == 2
