"""dedupe.testing's Recorder and the check's comparison and table, without any service."""

from __future__ import annotations

from dedupe.testing import CASES, Case, CaseResult, Recorder, Report, Run
from dedupe.testing.check import (
    NOT_FROM_KEY,
    OUTSIDE_CTX_DB,
    STEP_NOT_IDEMPOTENT,
    _causes,
    _compare,
)
from dedupe.testing.recorder import Call, distinct_keys


def result(name: str, *, rows: int, keys: list[str | None], outcome: str = "acked") -> CaseResult:
    [case] = [c for c in CASES if c.name == name]
    calls = [Call(key, {"amount_cents": 5}, "a") for key in keys]
    return CaseResult(case, [Run("s", "k", "a")], [("p", 5)] * rows, calls, outcome, [], 0.1)


def test_a_recorder_keeps_each_call_with_its_key_and_no_worker_outside_a_run() -> None:
    """record(key, **what): the key first (what may hold a 'key' of its own), in order."""
    recorder = Recorder()
    recorder.record("k-1", key="inner", amount_cents=5)
    recorder.record("k-1")
    recorder.record(None, to="x@example.com")
    assert [call.key for call in recorder.calls] == ["k-1", "k-1", None]
    assert recorder.calls[0].what == {"key": "inner", "amount_cents": 5}
    assert recorder.keys() == ["k-1", None] and len(recorder) == 3
    assert all(call.worker is None for call in recorder.calls)


def test_calls_without_a_key_count_as_a_new_key_each() -> None:
    """The other side cannot recognise a repeat of a call that carried no key."""
    calls = [Call(None, {}, "a"), Call(None, {}, "b"), Call("k", {}, "a"), Call("k", {}, "b")]
    assert distinct_keys(calls) == 3


def test_a_case_fails_on_rows_keys_or_outcome_that_differ_from_a_single_delivery() -> None:
    """More rows, fewer rows, more keys, another outcome: each is a problem; repeats are not."""
    once = result("once", rows=1, keys=["k"])
    assert _compare([("p", 5)], [Call("k", {}, "a"), Call("k", {}, "b")], "acked", once) == []
    [twice] = _compare([("p", 5)] * 2, [], "acked", once)
    assert twice.startswith("2 effect rows where a single delivery left 1")
    [lost] = _compare([], [], "acked", once)
    assert lost.startswith("0 effect rows")
    [keys] = _compare([("p", 5)], [Call("x", {}, "a"), Call("y", {}, "b")], "acked", once)
    assert keys.startswith("external calls with 2 different keys")
    [dead] = _compare([("p", 5)], [], "dead-lettered (rejected)", once)
    assert dead == "ended dead-lettered (rejected) where a single delivery was acked"


def test_the_table_has_a_row_per_case_and_the_failures_below_it() -> None:
    """One aligned row per case with its verdict; failures list problems, rows and calls."""
    ok = result("once", rows=1, keys=["k"])
    bad = CaseResult(
        Case("zombie", "woke late", ok.case.play),
        [Run("s", "k", "a"), Run("s", "k", "b")],
        [("p", 5), ("p", 5)],
        [Call("k", {"amount_cents": 5}, "a")],
        "acked",
        ["2 effect rows where a single delivery left 1"],
        0.1,
    )
    text = str(Report("app 'shop'", [ok, bad]))
    lines = text.splitlines()
    assert lines[0] == "exactly-once check of app 'shop': 1 of 2 cases FAILED"
    assert " ".join(lines[2].split()) == "case runs effect rows external calls outcome verdict"
    assert lines[3].split()[-1] == "ok" and lines[4].split()[-1] == "FAIL"
    assert "2 (a, b)" in lines[4] and not any(line != line.rstrip() for line in lines)
    assert "    rows: ('p', 5), ('p', 5)" in lines
    assert "      'k' by worker a: amount_cents=5" in lines


def test_rows_are_compared_by_content_and_the_differing_rows_shown() -> None:
    """As many rows as a single delivery left, with other values, fail; the same rows in
    another order do not (rows are a multiset)."""
    once = CaseResult(CASES[0], [Run("s", "k", "a")], [("p", 5), ("q", 1)], [], "acked", [], 0.1)
    assert _compare([("q", 1), ("p", 5)], [], "acked", once) == []
    [other] = _compare([("p", 6), ("q", 1)], [], "acked", once)
    assert other == (
        "2 effect rows as a single delivery left, but not the same"
        " (not left by a single delivery: ('p', 6); missing: ('p', 5))"
    )
    # A case whose handler was called once: other values are what two separate runs make
    # up differently (a uuid), not a repeat; another number of rows still fails.
    assert _compare([("p", 6), ("q", 1)], [], "acked", once, repeated=False) == []
    assert len(_compare([("p", 6)], [], "acked", once, repeated=False)) == 1


def test_each_failure_names_its_likely_cause() -> None:
    """Extra rows after a repeated run: a write outside ctx.db; new keys: a key not derived
    from ctx.key, or, at the crash after a step, a step that is not idempotent on retry."""
    once = result("once", rows=1, keys=["k"])
    [crash] = [c for c in CASES if c.name == "crash after handler"]
    [step] = [c for c in CASES if c.name == "crash after step"]
    runs = [Run("s", "k", "a"), Run("s", "k", "b")]
    calls = [Call("x", {}, "a"), Call("y", {}, "b")]
    assert _causes(crash, [("p", 5)] * 2, [], "acked", once, published=[], runs=runs) == [
        OUTSIDE_CTX_DB
    ]
    assert _causes(crash, [("p", 5)], calls, "acked", once, published=[], runs=runs) == [
        NOT_FROM_KEY
    ]
    assert _causes(step, [("p", 5)], calls, "acked", once, published=[], runs=runs) == [
        STEP_NOT_IDEMPOTENT
    ]
    assert "ctx.db" in OUTSIDE_CTX_DB and "ctx.key" in NOT_FROM_KEY
