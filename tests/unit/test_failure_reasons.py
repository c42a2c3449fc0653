"""A failed claim's reason and detail are read from their own columns, never parsed out of one
text."""

from __future__ import annotations

from dedupe.claims.records import Claim, Fence, Reason
from dedupe.claims.verdicts import Unsent, verdict_of


def failed(reason: str | None, error: str | None) -> Claim:
    """A failed row in the way whose dead letter was never confirmed."""
    return Claim(
        "s",
        "k",
        None,
        1,
        status="failed",
        same_payload=True,
        reason=reason,
        error=error,
        dead_lettered=False,
        row_token=7,
    )


def test_an_unsent_failure_keeps_its_reason_and_its_whole_detail() -> None:
    """The detail comes back as it was written, ': ' and all, under its own reason."""
    verdict = verdict_of(failed("rejected", "card: declined: twice"))
    assert verdict == Unsent(Reason.REJECTED, "card: declined: twice", Fence("s", "k", 7))


def test_a_failure_recorded_without_a_reason_is_a_handler_error_with_its_detail_whole() -> None:
    """An error written with no reason (by hand, or by a worker older than migration 0010) is
    not cut at its first ': ' as if it started with one."""
    verdict = verdict_of(failed(None, "ValueError: boom"))
    assert verdict == Unsent(Reason.HANDLER_ERROR, "ValueError: boom", Fence("s", "k", 7))


def test_a_reason_this_version_does_not_know_reads_as_a_handler_error() -> None:
    verdict = verdict_of(failed("from_the_future", "x"))
    assert isinstance(verdict, Unsent) and verdict.reason is Reason.HANDLER_ERROR
    assert verdict_of(failed(None, None)) == Unsent(Reason.HANDLER_ERROR, "", Fence("s", "k", 7))
