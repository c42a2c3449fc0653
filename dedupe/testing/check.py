"""The exactly-once check: one message through every way a delivery goes wrong (duplicates, a
lost ack, a crash at each point, a zombie), each case in a fresh database, compared with a
single delivery; a readable table, and an AssertionError when an effect happened twice."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
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
        "crash after step",
        "the worker died after a ctx.step's function returned, before its result was recorded",
        _crash("stepped"),
    ),
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
    """What one case did: the handler's starts, its rows and external calls, the outcome;
    what differs from a single delivery (`problems`) and what most likely causes it
    (`causes`); `reached`: False when the case's crash point never came (no ctx.step)."""

    case: Case
    runs: list[Run]
    rows: list[tuple[Any, ...]] | None
    calls: list[Call]
    outcome: str
    problems: list[str]
    seconds: float
    causes: list[str] = field(default_factory=list)
    reached: bool = True
    published: list[tuple[str, str, bytes]] = field(default_factory=list)
    detail: str | None = None  # the last dead letter's detail, if any

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        if self.problems:
            return "FAIL"
        return "ok" if self.reached else "n/a"


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
                r.verdict,
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
        unreached = [r for r in self.results if not r.reached]
        if unreached:
            names = ", ".join(r.case.name for r in unreached)
            lines.append(f"n/a: {names}: never reached (the handler called no ctx.step)")
        if failed:
            lines += ["", "failures:"]
            for result in failed:
                lines.append(f"  {result.case.name}:")
                lines += [f"    {problem}" for problem in result.problems]
                lines += [f"    likely cause: {cause}" for cause in result.causes]
                if result.detail:
                    lines.append(f"    dead letter: {result.detail}")
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

    A case fails when its `effects` rows are not those of a single delivery (compared by
    content, as multisets: a write twice, one lost, one with other values), when its
    `external` calls carry more distinct keys (a repeated call the other side cannot
    recognise), when it publishes (ctx.publish) other message ids, or one id with two bodies,
    or when it ends otherwise (a dead letter where a single delivery was acked). Raises
    NotExactlyOnce (an AssertionError) with the table, the differing rows and the likely
    cause of each failure then; returns the Report otherwise.

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
        reached = not run.armed
        published = [(m.channel, m.message_id or "", m.body) for m in run.published]
        detail = run.dead_letters[-1].detail if run.dead_letters else None
    calls = external.calls[first_call:] if external is not None else []
    problems: list[str] = []
    causes: list[str] = []
    if baseline is not None:
        repeated = sum(r.ran for r in runs) > 1
        problems = _compare(rows, calls, outcome, baseline, published=published, repeated=repeated)
        if problems:
            causes = _causes(case, rows, calls, outcome, baseline, published=published, runs=runs)
    return CaseResult(
        case,
        runs,
        rows,
        calls,
        outcome,
        problems,
        time.perf_counter() - began,
        causes=causes,
        reached=reached,
        published=published,
        detail=detail,
    )


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
    rows: list[tuple[Any, ...]] | None,
    calls: list[Call],
    outcome: str,
    baseline: CaseResult,
    *,
    published: list[tuple[str, str, bytes]] | None = None,
    repeated: bool = True,
) -> list[str]:
    """What differs from a single delivery. `repeated`: whether the handler was called more
    than once in the case; if not, rows as many as the single delivery's but with other values
    are what any two separate runs make up differently (a uuid, the time), not a repeat."""
    problems = []
    if rows is not None and baseline.rows is not None:
        extra, missing = _difference(rows, baseline.rows)
        if (extra or missing) and (repeated or len(rows) != len(baseline.rows)):
            if len(rows) != len(baseline.rows):
                what = f"{len(rows)} effect rows where a single delivery left {len(baseline.rows)}"
            else:
                what = f"{len(rows)} effect rows as a single delivery left, but not the same"
            differ = [f"not left by a single delivery: {_rows(extra)}"] if extra else []
            differ += [f"missing: {_rows(missing)}"] if missing else []
            problems.append(f"{what} ({'; '.join(differ)})")
    if published is not None:
        # By id (a relay may send a row twice: the same message, a duplicate downstream); a
        # body may differ from the single delivery's (a timestamp), not between two sends.
        ids, expected_ids = _ids(published), _ids(baseline.published)
        if ids - expected_ids:
            problems.append(
                "published messages a single delivery did not publish: "
                + _messages(m for m in published if (m[0], m[1]) in ids - expected_ids)
            )
        if expected_ids - ids:
            problems.append(
                "messages a single delivery published that are missing: "
                + _messages(m for m in baseline.published if (m[0], m[1]) in expected_ids - ids)
            )
        bodies: dict[tuple[str, str], set[bytes]] = {}
        for channel, message_id, body in published:
            bodies.setdefault((channel, message_id), set()).add(body)
        for (channel, message_id), seen in bodies.items():
            if len(seen) > 1:
                problems.append(
                    f"{channel} {message_id!r} published with {len(seen)} different bodies: "
                    "a consumer that checks payloads takes the second for a key conflict, one "
                    "that does not drops it"
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


OUTSIDE_CTX_DB = (
    "a write outside ctx.db: it commits at once, so what a run that died or was taken over "
    "wrote stays, and its retry writes again (write through ctx.db: it commits with the "
    "outcome, or not at all)"
)
NOT_FROM_KEY = (
    "an external call keyed by something not derived from ctx.key (uuid4(), a timestamp, "
    "a counter): a retry calls again with another key, which the other side takes for a new "
    'call (pass ctx.key, or f"{ctx.key}/<what>")'
)
STEP_NOT_IDEMPOTENT = (
    "a ctx.step whose function is not idempotent on retry: the worker died after its call "
    "and before its record, so the retry called it again, with another key (give the "
    'external system f"{ctx.key}/<step name>" as its idempotency key)'
)
NO_KEY = (
    "an external call without an idempotency key: a retry's call cannot be told from a new "
    "one (pass one derived from ctx.key)"
)
PUBLISH_KEY = (
    "a ctx.publish(key=...) not derived from ctx.key: a retry publishes another message "
    "(leave key= out, or derive it from ctx.key)"
)
RETRY_FAILED = (
    "the retry of a run that died failed where a single delivery did not: most likely on "
    "what the dead run wrote outside ctx.db (a unique key it left, say); or a max_attempts "
    "too low to retry after a crash"
)


def _causes(
    case: Case,
    rows: list[tuple[Any, ...]] | None,
    calls: list[Call],
    outcome: str,
    baseline: CaseResult,
    *,
    published: list[tuple[str, str, bytes]],
    runs: list[Run],
) -> list[str]:
    """The likely causes of a case's differences from a single delivery, most likely first."""
    causes: list[str] = []
    repeated = sum(r.ran for r in runs) > 1
    new_keys = distinct_keys(calls) > distinct_keys(baseline.calls)
    if new_keys:
        if any(call.key is None for call in calls):
            causes.append(NO_KEY)
        if any(call.key is not None for call in calls):
            causes.append(STEP_NOT_IDEMPOTENT if case.name == "crash after step" else NOT_FROM_KEY)
    if rows is not None and baseline.rows is not None:
        extra, missing = _difference(rows, baseline.rows)
        more = len(rows) > len(baseline.rows)
        # Other values in as many rows, with new keys: most likely made from the new key.
        if repeated and (more or (extra and not new_keys)):
            causes.append(OUTSIDE_CTX_DB)
        elif (extra or missing) and not new_keys:
            causes.append(
                "an effect that depends on the run (a value made in the handler, ctx.attempt,"
                " the time) or a write outside ctx.db"
            )
    if _ids(published) - _ids(baseline.published):
        causes.append(PUBLISH_KEY)
    if outcome != baseline.outcome and not causes:
        causes.append(RETRY_FAILED if len(runs) > 1 else "see the dead letter's detail")
    return causes


def _difference(rows: Sequence[Any], expected: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(rows not in `expected`, rows of `expected` not in `rows`), as multisets: a row twice
    where one was expected is one extra."""
    left = list(expected)
    extra = []
    for row in rows:
        for i, wanted in enumerate(left):
            if _same(row, wanted):
                del left[i]
                break
        else:
            extra.append(row)
    return extra, left


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values whose == refuses (arrays, say): compared as they print
        return repr(a) == repr(b)


def _ids(published: list[tuple[str, str, bytes]]) -> set[tuple[str, str]]:
    return {(channel, message_id) for channel, message_id, _ in published}


def _messages(sent: Iterable[tuple[str, str, bytes]]) -> str:
    shown: dict[tuple[str, str], str] = {}
    for channel, message_id, body in sent:
        shown.setdefault((channel, message_id), body[:80].decode(errors="replace"))
    return ", ".join(f"{c} {i!r} {text!r}" for (c, i), text in shown.items())


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
