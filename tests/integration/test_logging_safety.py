"""No secret, signature or payload body ever reaches the logs, at any level."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import BaseModel

from dedupe import App, Context
from dedupe.claims.store import ClaimStore
from dedupe.pipeline.processor import Processor
from dedupe.testing.deliveries import MemoryDelivery, make_message

SECRET_BODY = "4111111111111111"
SIGNATURE = "v1,U0VDUkVULVNJR05BVFVSRQ=="
TOKEN = "Bearer sk_live_very_secret"


class Card(BaseModel):
    number: str
    n: int


async def test_the_pipeline_logs_message_fields_but_no_payload_or_header(
    store: ClaimStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Retries, dead letters, conflicts and duplicates log scope/key/id/attempt, not bodies."""
    app = App("safe")

    @app.handler("cards", max_attempts=2, backoff_s=0.01)
    async def charge(card: Card, ctx: Context) -> None:
        ctx.logger.info("charging")
        if card.n < 0:
            raise RuntimeError("declined")

    def delivery(key: str, n: int) -> MemoryDelivery:
        body = json.dumps({"number": SECRET_BODY, "n": n})
        headers = {"webhook-signature": SIGNATURE, "Authorization": TOKEN}
        return MemoryDelivery(make_message("cards", body, message_id=key, headers=headers))

    caplog.set_level(logging.DEBUG)
    async with Processor(app, store) as processor:
        await processor.process("cards", [delivery("ok", 1), delivery("bad", -1)])
        await processor.process("cards", [delivery("ok", 1), delivery("ok2", 1)])
        await processor.process("cards", [delivery("ok", 2)])  # conflict
        await processor.process("cards", [MemoryDelivery(make_message("cards", "not json{"))])
    text = caplog.text + "".join(repr(r.__dict__) for r in caplog.records)
    for secret in (SECRET_BODY, SIGNATURE, TOKEN, "sk_live"):
        assert secret not in text
    outcomes = {
        (r.key, r.outcome) for r in caplog.records if getattr(r, "outcome", None) is not None
    }
    assert {("ok", "completed"), ("ok", "duplicate"), ("ok", "conflict")} <= outcomes
    assert ("bad", "dead_lettered") in outcomes
    retry = next(r for r in caplog.records if "retrying" in r.getMessage())
    assert (retry.scope, retry.key, retry.message_id, retry.attempt) == (
        "safe.charge",
        "bad",
        "bad",
        1,
    )
    settled = [r for r in caplog.records if r.name == "dedupe.outcome"]
    assert all(
        {"scope", "key", "message_id", "attempt", "outcome"} <= set(r.__dict__) for r in settled
    )
