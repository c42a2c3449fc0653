"""The webhooks example's worker side (handlers/webhooks.py) under dedupe.testing: a delivery the
receiver forwarded is recorded once, whatever becomes of it on the way."""

from __future__ import annotations

import pytest

from dedupe.testing import TestRun, check_exactly_once
from handlers import webhooks
from tests.conftest import ADMIN_URL

EFFECTS = "SELECT message_id, source, kind FROM webhook_events"


@pytest.mark.parametrize(
    ("channel", "message_id", "headers", "kind"),
    [
        ("github", "github/d-1", {"X-GitHub-Event": "push"}, "push"),
        (
            "orders",
            "orders/tenant-a/o-1",
            {"x-dedupe-webhook-tenant": "tenant-a"},
            "order:tenant-a",
        ),
    ],
)
async def test_a_forwarded_webhook_is_recorded_exactly_once_through_every_crash_point(
    channel: str, message_id: str, headers: dict[str, str], kind: str
) -> None:
    """One webhook_events row (a table without UNIQUE, so a repeat would show) in every case."""
    report = await check_exactly_once(
        webhooks.app,
        channel,
        b'{"action": "opened"}',
        message_id=message_id,
        headers=headers,
        database_url=ADMIN_URL,
        schema=webhooks.SCHEMA,
        effects=EFFECTS,
    )
    assert report.ok
    assert report.results[0].rows == [(message_id, channel, kind)]


async def test_a_stripe_event_is_recorded_with_the_type_its_body_names() -> None:
    """The stripe handler reads the event type from the body; the result names the key."""
    async with TestRun(webhooks.app, database_url=ADMIN_URL, schema=webhooks.SCHEMA) as run:
        run.publish(
            "stripe", {"id": "evt_1", "type": "charge.succeeded"}, message_id="stripe/evt_1"
        )
        await run.idle()
        assert await run.fetch(EFFECTS) == [("stripe/evt_1", "stripe", "charge.succeeded")]
        assert await run.result("stripe/evt_1") == {"recorded": "stripe/evt_1"}
