"""The exactly-once check: one message through every way a delivery goes wrong (duplicates, a
lost ack, a crash at each point, a zombie), each case in a fresh database, compared with a
single delivery; a readable table, and an AssertionError when an effect happened twice."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dedupe.app import App
from dedupe.testing.databases import Schema
from dedupe.testing.deliveries import Sent
from dedupe.testing.recorder import Call, Recorder, distinct_keys
from dedupe.testing.run import TestRun
from dedupe.testing.stages import Run

Effects = str | Callable[[TestRun], Awaitable[Sequence[Any]]]
Send = Callable[..., Sent]


@dataclass(frozen=True, slots=True)
class Case:
    """A way the message's delivery goes wrong, and how the run plays it."""

    name: str
    what: str
    play: Callable[[TestRun, Send], Awaitable[None]] = field(repr=False)


async def _once(run: TestRun, send: Send) -> None:
    send()
    await run.idle()


async def _duplicate_at_once(run: TestRun, send: Send) -> None:
    send(copies=2)
    await run.idle()


async def _duplicate_later(run: TestRun, send: Send) -> None:
    send()
    await run.idle()
    send()
    await run.idle()


async def _ack_lost(run: TestRun, send: Send) -> None:
    send(lose_ack=True)
    await run.idle()


def _crash(stage: str) -> Callable[[TestRun, Send], Awaitable[None]]:
    async def play(run: TestRun, send: Send) -> None:
        run.crash_at(stage)  # type: ignore[arg-type]
        send()
        await run.idle()

    return play


async def _zombie(run: TestRun, send: Send) -> None:
    stall = run.stall_at("handled")
    send()
    await stall.reached(run.timeout_s)
    await run.take_over()
    # The new worker completes the message meanwhile, or waits behind a row the zombie's
    # open transaction holds (as it would in production, until the zombie wakes or dies).
    for _ in range(math.ceil(run.timeout_s / 0.01)):
        if run.quiet or await run.blocked():
            break
        await asyncio.sleep(0.01)
    stall.resume()
    await run.idle()


CASES: tuple[Case, ...] = (
    Case("once", "delivered once: what every other case must match", _once),
    Case("duplicate at once", "two copies at the same moment", _duplicate_at_once),
    Case("duplicate later", "sent again after the first was acked", _duplicate_later),
    Case("ack lost", "acked, but the broker never got the ack", _ack_lost),
    Case("crash after claim", "the worker died before the handler ran", _crash("claimed")),
    Case(
        "crash after handler",
        "the worker died after the handler returned, before the commit",
        _crash("handled"),
    ),
    Case(
        "crash before ack",
        "the worker died after the commit, before the ack",
        _crash("completed"),
    ),
    Case(
        "zombie",
        "frozen after its handler; another worker took over; then it woke",
        _zombie,
    ),
)


@dataclass(frozen=True, slots=True)
class CaseResult:
    """What one case did: the handler's starts, its rows and external calls, the outcome."""

    case: Case
    runs: list[Run]
    rows: list[tuple[Any, ...]] | None
    calls: list[Call]
    outcome: str
    problems: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


class Report:
    """Every case of a check; str() is the table."""

    def __init__(self, subject: str, results: list[CaseResult]) -> None:
        self.subject = subject
        self.results = results

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    @property
    def failed(self) -> list[CaseResult]:
        return [result for result in self.results if not result.ok]

    def __str__(self) -> str:
        failed = self.failed
        verdict = f"{len(failed)} of {len(self.results)} cases FAILED" if failed else "all ok"
        head = ("case", "runs", "effect rows", "external calls", "outcome", "verdict")
        lines = [f"exactly-once check of {self.subject}: {verdict}", ""]
        body = [
            (
                r.case.name,
                _runs(r.runs),
                "-" if r.rows is None else str(len(r.rows)),
                _calls(r.calls),
                r.outcome,
                "ok" if r.ok else "FAIL",
            )
            for r in self.results
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        for row in [head, *body]:
            cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
            lines.append("  ".join(cells).rstrip())
        lines += [
            "",
            "runs: the runs of the key that began (claimed), and by which workers",
            "cases:",
        ]
        lines += [f"  {r.case.name}: {r.case.what}" for r in self.results]
        if failed:
            lines += ["", "failures:"]
            for result in failed:
                lines.append(f"  {result.case.name}:")
                lines += [f"    {problem}" for problem in result.problems]
                if result.rows is not None:
                    lines.append(f"    rows: {_rows(result.rows)}")
                if result.calls:
                    lines.append("    calls:")
                    lines += [f"      {call.describe()}" for call in result.calls]
        return "\n".join(lines).rstrip()


class NotExactlyOnce(AssertionError):
    """A handler's effect happened twice (or not at all) in some case of the check."""

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


NotExactlyOnce.__module__ = "dedupe.testing"  # how tracebacks name it: where users import it


async def check_exactly_once(
    app: App,
    channel: str,
    body: bytes | str | Any,
    *,
    database_url: str,
    schema: Schema | None = None,
    headers: Mapping[str, Any] | None = None,
    message_id: str = "exactly-once-check",
    effects: Effects | None = None,
    external: Recorder | None = None,
    timeout_s: float = 30.0,
) -> Report:
    """Run one message through every case in CASES and compare each with a single delivery.

    A case fails when it leaves another number of `effects` rows than a single delivery did
    (a ctx.db write twice, or lost), when its `external` calls carry more distinct keys (a
    repeated call the other side cannot recognise), or when it ends otherwise (a dead letter
    where a single delivery was acked). Raises NotExactlyOnce (an AssertionError) with the
    table then; returns the Report otherwise.

    Args:
        app: The app under test, as the worker runs it.
        channel: Where the message is published.
        body: The message (bytes, text, a pydantic model or a JSON value).
        database_url: The PostgreSQL server to make each case's database on.
        schema: The app's own tables (SQL, or an async callable given a database URL).
        headers: The message's headers (an Idempotency-Key, a tenant).
        message_id: The message's broker id (the key of handlers with key="message_id").
        effects: What the handler wrote: a query returning one row per effect (select the
            columns that say what it is, not generated ids), or an async callable given the
            TestRun that returns such rows.
        external: The Recorder the app's fake external clients record their calls in.
        timeout_s: How long each case may take to settle.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the table, not our frames
    results: list[CaseResult] = []
    baseline: CaseResult | None = None
    for case in CASES:
        result = await _play(
            case,
            app,
            channel,
            body,
            baseline,
            database_url=database_url,
            schema=schema,
            headers=headers,
            message_id=message_id,
            effects=effects,
            external=external,
            timeout_s=timeout_s,
        )
        if baseline is None:
            baseline = result
            if result.outcome != "acked":
                raise AssertionError(
                    f"a single delivery of {message_id!r} on {channel!r} was not acked "
                    f"({result.outcome}): the check needs a message the handler completes"
                )
        results.append(result)
    handlers = ", ".join(h.name for h in app.channels.get(channel, []))
    keys = ", ".join(repr(k) for k in dict.fromkeys(run.key for run in results[0].runs))
    report = Report(f"app {app.name!r}, channel {channel!r} ({handlers}), key {keys}", results)
    if not report.ok:
        raise NotExactlyOnce(report)
    return report


async def _play(
    case: Case,
    app: App,
    channel: str,
    body: bytes | str | Any,
    baseline: CaseResult | None,
    *,
    database_url: str,
    schema: Schema | None,
    headers: Mapping[str, Any] | None,
    message_id: str,
    effects: Effects | None,
    external: Recorder | None,
    timeout_s: float,
) -> CaseResult:
    began = time.perf_counter()
    first_call = len(external.calls) if external is not None else 0
    async with TestRun(app, database_url=database_url, schema=schema, timeout_s=timeout_s) as run:

        def send(**options: Any) -> Sent:
            return run.publish(channel, body, message_id=message_id, headers=headers, **options)

        await case.play(run, send)
        rows = await _effects(run, effects)
        outcome = _outcome(run)
        runs = list(run.runs)
    calls = external.calls[first_call:] if external is not None else []
    problems = [] if baseline is None else _compare(rows, calls, outcome, baseline)
    return CaseResult(case, runs, rows, calls, outcome, problems, time.perf_counter() - began)


async def _effects(run: TestRun, effects: Effects | None) -> list[tuple[Any, ...]] | None:
    if effects is None:
        return None
    rows = await run.fetch(effects) if isinstance(effects, str) else await effects(run)
    return [tuple(row.values()) if hasattr(row, "values") else tuple(row) for row in rows]


def _outcome(run: TestRun) -> str:
    """What became of the message: acked, or dead-lettered with the reason."""
    dead = run.dead_letters
    if dead:
        return f"dead-lettered ({dead[-1].reason})"
    return "acked" if run.acked else "not settled"


def _compare(
    rows: list[tuple[Any, ...]] | None, calls: list[Call], outcome: str, baseline: CaseResult
) -> list[str]:
    problems = []
    if rows is not None and baseline.rows is not None and len(rows) != len(baseline.rows):
        problems.append(
            f"{len(rows)} effect rows where a single delivery left {len(baseline.rows)}"
            + (": a write outside ctx.db, or one that repeats" if len(rows) > 1 else "")
        )
    keys, expected = distinct_keys(calls), distinct_keys(baseline.calls)
    if keys > expected:
        problems.append(
            f"external calls with {keys} different keys where a single delivery used "
            f"{expected}: the other side cannot tell a repeat from a new call (pass a key "
            "derived from ctx.key)"
        )
    if outcome != baseline.outcome:
        problems.append(f"ended {outcome} where a single delivery was {baseline.outcome}")
    return problems


def _runs(runs: list[Run]) -> str:
    workers = ", ".join(dict.fromkeys(run.worker for run in runs))
    return f"{len(runs)} ({workers})" if runs else "0"


def _calls(calls: list[Call]) -> str:
    if not calls:
        return "-"
    keys = distinct_keys(calls)
    return f"{len(calls)} with {keys} key{'s' if keys != 1 else ''}"


def _rows(rows: list[tuple[Any, ...]]) -> str:
    shown = ", ".join(repr(row) for row in rows[:5])
    return shown + (f", ... ({len(rows)} in all)" if len(rows) > 5 else "") if rows else "none"


__all__ = ["CASES", "Case", "CaseResult", "NotExactlyOnce", "Report", "check_exactly_once"]
