"""The payments example (handlers/payments.py) under dedupe.testing: exactly once through every
crash point, and what it does with a refused charge or a bad amount. Its provider is replaced by
a fake that records each call with its idempotency key, as a user's test would."""

from __future__ import annotations

import hashlib

import pytest

from dedupe.claims.records import Reason
from dedupe.testing import Recorder, TestRun, check_exactly_once
from handlers import payments
from handlers.provider import ProviderUnavailable
from tests.conftest import ADMIN_URL

BODY = {"payment_id": "pay-1", "customer": "cus-1", "amount_cents": 1250}
EFFECTS = "SELECT payment_id, customer, amount_cents, charge_id, idempotency_key FROM charges"


class FakeProvider:
    """The payment API as the example's provider behaves: same key, same charge; poison fails."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def charge(self, *, idempotency_key: str, payment_id: str, amount_cents: int) -> str:
        self.recorder.record(idempotency_key, payment_id=payment_id, amount_cents=amount_cents)
        if payment_id.startswith("poison"):
            raise ProviderUnavailable(f"provider keeps failing for {payment_id}")
        return "ch_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The calls the handler makes to the (fake) provider."""
    recorder = Recorder()
    monkeypatch.setattr(payments, "provider", FakeProvider(recorder))
    return recorder


async def test_the_payments_handler_is_exactly_once_through_every_crash_point(
    recorder: Recorder,
) -> None:
    """One charge row and one idempotency key in every case of check_exactly_once."""
    report = await check_exactly_once(
        payments.app,
        "payments",
        BODY,
        message_id="pay-1",
        database_url=ADMIN_URL,
        schema=payments.setup,
        effects=EFFECTS,
        external=recorder,
    )
    assert report.ok
    assert recorder.keys() == ["pay-1/charge"]


async def test_a_charge_is_recorded_with_its_charge_id_and_stored_as_the_result(
    recorder: Recorder,
) -> None:
    """The row written through ctx.db and the stored result carry the provider's charge id."""
    async with TestRun(payments.app, database_url=ADMIN_URL, schema=payments.setup) as run:
        run.publish("payments", BODY, message_id="pay-1")
        await run.idle()
        [row] = await run.fetch(EFFECTS)
        result = await run.result("pay-1")
    assert result == {"charge_id": row["charge_id"]}
    assert tuple(row)[:3] == ("pay-1", "cus-1", 1250) and row["idempotency_key"] == "pay-1/charge"


async def test_a_charge_the_provider_keeps_refusing_is_dead_lettered_after_three_calls(
    recorder: Recorder,
) -> None:
    """max_attempts=3: three calls with the same key, then a dead letter and no charge row."""
    body = {**BODY, "payment_id": "poison-1"}
    async with TestRun(payments.app, database_url=ADMIN_URL, schema=payments.setup) as run:
        run.publish("payments", body, message_id="pay-poison")
        await run.idle()
        [dead] = run.dead_letters
        assert dead.reason is Reason.MAX_ATTEMPTS
        assert "ProviderUnavailable" in (dead.detail or "")
        assert await run.fetchval("SELECT count(*) FROM charges") == 0
        [claim] = await run.claims()
        assert (claim.status, claim.attempts) == ("failed", 3)
    assert [call.key for call in recorder.calls] == ["pay-poison/charge"] * 3


async def test_a_payment_without_a_positive_amount_is_dead_lettered_uncharged(
    recorder: Recorder,
) -> None:
    """The model refuses amount_cents=0: invalid_payload, and the provider is never called."""
    async with TestRun(payments.app, database_url=ADMIN_URL, schema=payments.setup) as run:
        run.publish("payments", {**BODY, "amount_cents": 0}, message_id="pay-0")
        await run.idle()
        [dead] = run.dead_letters
        assert dead.reason is Reason.INVALID_PAYLOAD
    assert recorder.calls == []
