"""The dead-letter replay policy without a broker: what goes back, what is released first."""

from __future__ import annotations

from typing import Any

from dedupe.claims.records import Reason
from dedupe.operations.replay import ReplayPolicy, describe
from dedupe.transport import (
    BODY_DROPPED_HEADER,
    DETAIL_HEADER,
    KEY_HEADER,
    REASON_HEADER,
    SCOPE_HEADER,
)


def dead_letter(reason: Reason | str, **extra: Any) -> dict[str, Any]:
    return {
        "traceparent": "00-abc-def-01",
        REASON_HEADER: str(reason),
        DETAIL_HEADER: "boom",
        SCOPE_HEADER: "shop.charge",
        KEY_HEADER: "pay-42",
        **extra,
    }


def test_a_replayed_dead_letter_loses_our_headers_and_keeps_the_senders() -> None:
    """The reason, detail, scope and key headers go; the sender's own headers stay."""
    step = ReplayPolicy().plan(dead_letter(Reason.HANDLER_ERROR), message_id="m-1")
    assert step.headers == {"traceparent": "00-abc-def-01"}
    assert step.skipped is None


def test_a_transports_own_headers_are_stripped_too() -> None:
    """A broker names the headers it adds (RabbitMQ's deferral count, Kafka's origin)."""
    headers = dead_letter(Reason.REJECTED, **{"x-dedupe-deferrals": 3, "x-other": "kept"})
    step = ReplayPolicy(own_headers=("x-dedupe-deferrals",)).plan(headers, message_id=None)
    assert step.headers == {"traceparent": "00-abc-def-01", "x-other": "kept"}


def test_only_a_dead_letter_of_its_own_failed_claim_releases_that_claim() -> None:
    """Given up, rejected, undecodable: release; a conflict names another payload's claim."""
    policy = ReplayPolicy()
    for reason in (
        Reason.MAX_ATTEMPTS,
        Reason.HANDLER_ERROR,
        Reason.REJECTED,
        Reason.INVALID_PAYLOAD,
    ):
        assert policy.plan(dead_letter(reason), message_id="m").release == ("shop.charge", "pay-42")
    for reason in (Reason.KEY_CONFLICT, Reason.MISSING_KEY, Reason.NO_HANDLER, Reason.INVALID_KEY):
        assert policy.plan(dead_letter(reason), message_id="m").release is None
    without_key = {REASON_HEADER: str(Reason.HANDLER_ERROR), SCOPE_HEADER: "shop.charge"}
    assert policy.plan(without_key, message_id="m").release is None


def test_a_dead_letter_written_without_its_body_is_skipped() -> None:
    """It cannot run again: nothing is released and nothing republished, and it says why."""
    headers = dead_letter(Reason.HANDLER_ERROR, **{BODY_DROPPED_HEADER: "2000000 bytes: too big"})
    step = ReplayPolicy().plan(headers, message_id="m-1")
    assert step.skipped == "it was dead-lettered without its body (2000000 bytes: too big)"
    assert step.release is None


def test_the_row_names_the_message_its_reason_and_its_claim() -> None:
    """What `dlq replay` reports, and `dlq list` shows with the detail."""
    step = ReplayPolicy().plan(dead_letter(Reason.MAX_ATTEMPTS), message_id="m-1")
    assert step.row == {
        "message_id": "m-1",
        "reason": "max_attempts_exceeded",
        "scope": "shop.charge",
        "key": "pay-42",
    }
    assert describe({}, message_id=None) == {
        "message_id": None,
        "reason": "?",
        "detail": "",
        "scope": None,
        "key": None,
    }


async def test_the_failed_claim_is_released_before_the_copy_goes_back() -> None:
    """A worker that sees the copy must find its claim claimable already."""
    done: list[str] = []

    async def release(scope: str, key: str) -> None:
        done.append(f"release {scope}/{key}")

    async def republish(headers: dict[str, Any]) -> str:
        done.append(f"republish {sorted(headers)}")
        return "sent"

    step = ReplayPolicy().plan(dead_letter(Reason.HANDLER_ERROR), message_id="m-1")
    assert await step.carry_out(release=release, republish=republish) == "sent"
    assert done == ["release shop.charge/pay-42", "republish ['traceparent']"]


async def test_a_replay_without_a_release_still_republishes() -> None:
    """`release=None` (tests, tools that leave the claims alone) republishes alone."""
    sent: list[dict[str, Any]] = []

    async def republish(headers: dict[str, Any]) -> None:
        sent.append(headers)

    step = ReplayPolicy().plan(dead_letter(Reason.HANDLER_ERROR), message_id="m-1")
    await step.carry_out(release=None, republish=republish)
    assert sent == [{"traceparent": "00-abc-def-01"}]
