"""bench.receiver's p99 verdict at half load, from made-up figures: no service, no run."""

from __future__ import annotations

from typing import Any

from bench.receiver import latency_verdict


def phase(p99_ms: float, *, rate: float = 1000.0, target: float | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "requests": 100,
        "planned": 100,
        "rate": rate,
        "p99_ms": p99_ms,
        "statuses": {202: 100},
    }
    if target is not None:
        figures["target_rate"] = target
    return figures


def test_the_p99_added_is_judged_against_the_bound() -> None:
    plain = phase(20.0, rate=4000)
    assert latency_verdict(plain, phase(5.0, target=1000), phase(11.0, target=1000), 7.0) == (
        True,
        "",
    )
    assert latency_verdict(plain, phase(5.0, target=1000), phase(13.0, target=1000), 7.0) == (
        False,
        "",
    )


def test_a_hand_written_baseline_slower_at_half_load_than_at_full_speed_gives_no_verdict() -> None:
    # The baseline's paced p99 above its closed-loop one: something else had the machine, and
    # the receiver's p99 minus it would pass where it should not.
    ok, why = latency_verdict(
        phase(20.0, rate=4000), phase(90.0, target=1000), phase(95.0, target=1000), 7.0
    )
    assert ok is None
    assert "machine was busy" in why


def test_a_paced_phase_short_of_its_rate_gives_no_verdict() -> None:
    plain = phase(20.0, rate=4000)
    short = phase(5.0, rate=500, target=1000)
    ok, why = latency_verdict(plain, short, phase(6.0, target=1000), 7.0)
    assert (ok, why) == (None, "a paced phase fell short of its rate or got non-2xx")


def test_no_commit_p99_gives_no_verdict() -> None:
    ok, why = latency_verdict(phase(20.0), phase(5.0, target=1000), phase(6.0, target=1000), None)
    assert ok is None and "commit p99" in why
