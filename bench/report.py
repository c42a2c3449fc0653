"""Render bench/run.py results as Markdown: figures, ratios, and each issue-14 target met or not.

    .venv/bin/python -m bench.report bench/results/latest.json [bench/results/memory.json]

Several files are merged (a later one's sections win), so the memory run of `make bench-memory`
joins the Targets table. Every verdict is computed from the figures; a target whose scenario is
not in the files says so instead of a verdict. Also reads the results of earlier runs (their
latency scenario measured half load alone).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

BROKERS = {"rabbit": "RabbitMQ", "kafka": "Kafka"}

# What each consumer of bench/worker.py is, in the words of the tables and the plots.
LABELS = {
    "raw": "raw client",
    "dedupe": "dedupe-worker",
    "naive": "naive consumer (SELECT key, INSERT key)",
    "faststream": "FastStream + the naive check",
}
RAW_CLIENT = {"rabbit": "aio-pika consume+ack", "kafka": "aiokafka getmany+commit"}
# The baselines of the write target, as the Targets table names them.
WRITE_BASES = {"naive": "the naive consumer", "raw": "the raw client doing the same insert"}

# issue 14's targets, as numbers the verdicts use.
ADDED_P99_MS = 10.0
WRITES_VS_NAIVE = 3.0
WRITES_VS_RAW = 1.5
KAFKA_NOOP_RATE = 20_000.0
RABBIT_NOOP_VS_RAW = 0.8
DUPLICATES_VS_NEW = 2.0
MEMORY_MB = 200.0
MEMORY_GROWTH_MB = 30.0  # "flat": what RSS may grow after the first samples
MEMORY_N = 1_000_000


@dataclass(frozen=True)
class Target:
    """One row of the Targets table; `met` is None when the run did not measure it."""

    target: str
    figure: str
    met: bool | None


def rate(report: dict[str, Any], broker: str, name: str) -> float | None:
    """The msg/s of one throughput run (`rabbit-dedupe/insert`), None if not run."""
    run = report.get(f"throughput_{broker}", {}).get(name)
    return float(run["rate"]) if run and run.get("rate") is not None else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def per_s(value: float | None) -> str:
    return f"{value:,.0f}/s" if value is not None else "not run"


def writes_figure(report: dict[str, Any], broker: str) -> tuple[str, float | None]:
    """The write-handler figure the targets use: group commit, else one commit per message."""
    group = rate(report, broker, f"{broker}-dedupe/insert-group")
    if group is not None:
        return "group commit", group
    return "one commit per message", rate(report, broker, f"{broker}-dedupe/insert")


def latency_runs(report: dict[str, Any]) -> dict[str, dict[int, dict[str, dict[str, Any]]]]:
    """broker -> offered rate -> "raw"/"dedupe" -> the paced run's result."""
    section = report.get("latency", {})
    out: dict[str, dict[int, dict[str, dict[str, Any]]]] = {b: {} for b in BROKERS}
    # Earlier runs kept one run per kind at half load, keyed by the kind alone.
    runs = section.get("runs", section)
    for key, run in runs.items():
        kind = key.split("@")[0]
        broker, _, consumer = kind.partition("-")
        if broker in out and isinstance(run, dict) and "target_rate" in run:
            out[broker].setdefault(int(run["target_rate"]), {})[consumer] = run
    return out


def half_max(report: dict[str, Any]) -> dict[str, int]:
    """Half of dedupe-worker's measured maximum per broker (the one rate of earlier runs)."""
    section = report.get("latency", {})
    if "half_max" in section:
        return {b: int(r) for b, r in section["half_max"].items()}
    return {b: min(rates) for b, rates in latency_runs(report).items() if rates}


def settled_all(run: dict[str, Any]) -> bool:
    return bool(run.get("sent")) and run.get("count", 0) >= run["sent"]


def short_of_rate(run: dict[str, Any], offered: int) -> bool:
    """Whether the load generator fell more than 5 % short of the rate it was to offer."""
    return bool(run.get("offered_rate")) and run["offered_rate"] < 0.95 * offered


def latency_targets(report: dict[str, Any]) -> list[Target]:
    runs = latency_runs(report)
    halves = half_max(report)
    fixed = report.get("latency", {}).get("fixed_rate")
    out: list[Target] = []
    for broker, name in BROKERS.items():
        for label, at in (("half of the maximum", halves.get(broker)), ("1,000/s", fixed)):
            target = f"p99 at most raw p99 + {ADDED_P99_MS:.0f} ms at {label}, {name}"
            offered = int(at or 0)
            pair = runs[broker].get(offered, {})
            raw, ded = pair.get("raw"), pair.get("dedupe")
            if not raw or not ded or raw["p99_ms"] is None or ded["p99_ms"] is None:
                out.append(Target(target, "not measured in this run", None))
                continue
            added = ded["p99_ms"] - raw["p99_ms"]
            figure = (
                f"{added:+.1f} ms at {offered:,}/s (p99 {ded['p99_ms']:.1f} vs raw "
                f"{raw['p99_ms']:.1f} ms; p50 {ded['p50_ms']:.1f} vs {raw['p50_ms']:.1f})"
            )
            behind = [
                f"{k} settled {r['count']:,} of {r['sent']:,}"
                for k, r in (("raw", raw), ("dedupe-worker", ded))
                if not settled_all(r)
            ]
            if behind:
                figure += "; " + ", ".join(behind)
            slow = [
                f"{k}'s publisher reached only {r['offered_rate']:,.0f}/s"
                for k, r in (("raw", raw), ("dedupe-worker", ded))
                if short_of_rate(r, offered)
            ]
            if slow:
                # The load generator starved of CPU: the rate the target names was not offered.
                figure += "; " + ", ".join(slow) + ": not measured at this rate"
            met = None if slow else not behind and added <= ADDED_P99_MS
            out.append(Target(target, figure, met))
    return out


def throughput_targets(report: dict[str, Any]) -> list[Target]:
    out: list[Target] = []
    for broker, name in BROKERS.items():
        how, ded = writes_figure(report, broker)
        single = rate(report, broker, f"{broker}-dedupe/insert")
        for base, times in (("naive", WRITES_VS_NAIVE), ("raw", WRITES_VS_RAW)):
            target = f"handlers that write >= {times:g}x {WRITE_BASES[base]}, {name}"
            other = rate(report, broker, f"{broker}-{base}/insert")
            if ded is None or not other:
                out.append(Target(target, "not measured in this run", None))
                continue
            figure = f"{how} {ratio(ded, other)} ({ded:,.0f} vs {other:,.0f}/s)"
            if how == "group commit" and single is not None:
                figure += f"; one commit per message {ratio(single, other)}"
            out.append(Target(target, figure, ded >= times * other))
    kafka = rate(report, "kafka", "kafka-dedupe/noop")
    out.append(
        Target(
            f"Kafka no-op >= {KAFKA_NOOP_RATE:,.0f} msg/s per process",
            per_s(kafka) if kafka is not None else "not measured in this run",
            kafka >= KAFKA_NOOP_RATE if kafka is not None else None,
        )
    )
    ded, raw = (
        rate(report, "rabbit", "rabbit-dedupe/noop"),
        rate(report, "rabbit", "rabbit-raw/noop"),
    )
    out.append(
        Target(
            f"RabbitMQ no-op >= {RABBIT_NOOP_VS_RAW:g}x raw aio-pika",
            f"{ratio(ded, raw)} ({ded:,.0f} vs {raw:,.0f}/s)"
            if ded is not None and raw
            else "not measured in this run",
            ded >= RABBIT_NOOP_VS_RAW * raw if ded is not None and raw else None,
        )
    )
    return out


def duplicate_targets(report: dict[str, Any]) -> list[Target]:
    out: list[Target] = []
    for broker, name in BROKERS.items():
        target = f"duplicates >= {DUPLICATES_VS_NEW:g}x the rate of new keys, {name}"
        v = report.get("duplicates", {}).get(f"{broker}-dedupe")
        if not v or not v["new"]:
            out.append(Target(target, "not measured in this run", None))
            continue
        figure = f"{ratio(v['duplicates'], v['new'])} ({v['duplicates']:,.0f} vs {v['new']:,.0f}/s)"
        out.append(Target(target, figure, v["duplicates"] >= DUPLICATES_VS_NEW * v["new"]))
    return out


def memory_target(report: dict[str, Any]) -> Target:
    target = f"memory flat and < {MEMORY_MB:.0f} MB over {MEMORY_N:,} messages"
    m = report.get("memory")
    if not m or not m["rss_mb"]:
        return Target(target, "not in these results: `make bench-memory` (memory.json)", None)
    top = max(s[2] for s in m["rss_mb"])
    first = [s[2] for s in m["rss_mb"] if s[1] > 0][:3] or [top]
    grow = top - min(first)
    figure = f"max {top} MB, {grow:+.1f} MB after start, over {m['n']:,} messages"
    if m["n"] < MEMORY_N:
        return Target(target, figure + f" (fewer than {MEMORY_N:,})", None)
    return Target(target, figure, top < MEMORY_MB and grow < MEMORY_GROWTH_MB)


def targets(report: dict[str, Any]) -> list[Target]:
    """Every issue-14 target, in the issue's order, with its figure from `report`."""
    return [
        *latency_targets(report),
        *throughput_targets(report),
        *duplicate_targets(report),
        memory_target(report),
    ]


def _noop_table(report: dict[str, Any], broker: str) -> list[str]:
    section = report.get(f"throughput_{broker}")
    if not section:
        return []
    raw = rate(report, broker, f"{broker}-raw/noop")
    lines = [
        f"#### {BROKERS[broker]}: no-op handler (backlog, one process)",
        "",
        "| consumer | msg/s | vs raw |",
        "|---|---:|---:|",
    ]
    for consumer, label in LABELS.items():
        got = rate(report, broker, f"{broker}-{consumer}/noop")
        if got is not None:
            name = f"{label} ({RAW_CLIENT[broker]})" if consumer == "raw" else label
            lines.append(f"| {name} | {got:,.0f} | {ratio(got, raw)} |")
    for key, value in section.items():
        if key.count("/") == 2:  # the worker again on the other event loop
            loop = key.rsplit("/", 1)[1]
            lines.append(
                f"| dedupe-worker on {loop} | {value['rate']:,.0f} | {ratio(value['rate'], raw)} |"
            )
    for key in sorted(k for k in section if k.startswith("sql-loop-")):
        size = key.removeprefix("sql-loop-").replace("x", " keys x ") + " loops"
        lines.append(f"| bare claim+complete SQL loop ({size}) | {section[key]['rate']:,.0f} | - |")
    return [*lines, ""]


def _writes_table(report: dict[str, Any]) -> list[str]:
    rows: list[str] = []
    for broker, name in BROKERS.items():
        naive = rate(report, broker, f"{broker}-naive/insert")
        raw = rate(report, broker, f"{broker}-raw/insert")
        for consumer, handler, label in (
            ("raw", "insert", f"raw client + INSERT per message ({RAW_CLIENT[broker]})"),
            ("naive", "insert", LABELS["naive"] + " + the row, one transaction"),
            ("faststream", "insert", LABELS["faststream"] + " + the row"),
            ("dedupe", "insert", "dedupe-worker, `ctx.db` insert, one commit per message"),
            ("dedupe", "insert-group", "dedupe-worker, `ctx.db` insert, `group_commit=True`"),
        ):
            got = rate(report, broker, f"{broker}-{consumer}/{handler}")
            if got is not None:
                rows.append(
                    f"| {name} | {label} | {got:,.0f} | {ratio(got, naive)} | {ratio(got, raw)} |"
                )
    if not rows:
        return []
    return [
        "#### Handlers that write: one row inserted per message (backlog, one process)",
        "",
        "| broker | consumer | msg/s | vs naive | vs raw |",
        "|---|---|---:|---:|---:|",
        *rows,
        "",
    ]


def _latency_table(report: dict[str, Any]) -> list[str]:
    runs = latency_runs(report)
    if not any(runs.values()):
        return []
    halves, fixed = half_max(report), report.get("latency", {}).get("fixed_rate")
    lines = [
        "#### Latency, publish to settled, against the offered rate (no-op handler)",
        "",
        "| broker | offered | raw p50 | raw p99 | dedupe p50 | dedupe p99 | p99 added | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]

    def ms(run: dict[str, Any] | None, key: str) -> str:
        return f"{run[key]:.1f}" if run and run.get(key) is not None else "-"

    for broker, name in BROKERS.items():
        for offered, pair in sorted(runs[broker].items()):
            raw, ded = pair.get("raw"), pair.get("dedupe")
            notes = [
                n for n, r in (("half max", halves.get(broker)), ("target", fixed)) if r == offered
            ]
            for who, run in (("raw", raw), ("dedupe", ded)):
                if run and not settled_all(run):
                    notes.append(f"{who} settled {run['count']:,} of {run['sent']:,}")
                if run and short_of_rate(run, offered):
                    notes.append(f"{who}'s publisher reached {run['offered_rate']:,.0f}/s")
            added = "-"
            if raw and ded and raw.get("p99_ms") is not None and ded.get("p99_ms") is not None:
                added = f"{ded['p99_ms'] - raw['p99_ms']:+.1f}"
            lines.append(
                f"| {name} | {offered:,}/s | {ms(raw, 'p50_ms')} | {ms(raw, 'p99_ms')} | "
                f"{ms(ded, 'p50_ms')} | {ms(ded, 'p99_ms')} | {added} | {'; '.join(notes)} |"
            )
    return [*lines, "", "(milliseconds)", ""]


def _duplicates_table(report: dict[str, Any]) -> list[str]:
    if "duplicates" not in report:
        return []
    lines = [
        "#### Replays: the same keys again, nothing but duplicates (no-op handler)",
        "",
        "| worker | new keys msg/s | duplicates msg/s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for kind, v in report["duplicates"].items():
        new, dup = v["new"], v["duplicates"]
        lines.append(f"| {kind} | {new:,.0f} | {dup:,.0f} | {ratio(dup, new)} |")
    return [*lines, ""]


def _other_tables(report: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "gc" in report:
        g = report["gc"]
        lines += [
            "#### Clean-up of expired claims while the worker runs",
            "",
            f"- {g['deleted']:,} of {g['expired']:,} expired claims deleted at "
            f"**{g['gc_rate']:,} rows/s** of clean-up time; {g['deleted_while_worker_ran']:,} "
            f"of them while the worker ran at {g['worker_rate']:,.0f} msg/s",
            "",
        ]
    if "workers" in report:
        lines += [
            "#### Worker processes (no-op handler, rate from the claims' timestamps)",
            "",
            "| worker | 1 | 2 | 4 |",
            "|---|---:|---:|---:|",
        ]
        for kind in ("rabbit-dedupe", "kafka-dedupe"):
            cells = [report["workers"].get(f"{kind}/{c}", {}).get("rate", 0) for c in (1, 2, 4)]
            lines.append(f"| {kind} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
        lines.append("")
    if report.get("memory", {}).get("rss_mb"):
        m = report["memory"]
        samples = m["rss_mb"]
        lines += [
            "#### Resident memory of one Kafka worker",
            "",
            f"- {m['n']:,} messages at {m['rate']:,.0f} msg/s; "
            f"RSS max {max(s[2] for s in samples)} MB",
            "- samples (s, messages, MB): "
            + ", ".join(f"({t}, {c}, {mb})" for t, c, mb in samples[:: max(1, len(samples) // 12)]),
            "",
        ]
    return lines


def render(report: dict[str, Any]) -> str:
    """The Markdown of BENCHMARKS.md's result tables and its Targets table."""
    machine = report.get("machine", {})
    lines = []
    if machine:
        dirty = " with uncommitted changes" if machine.get("dirty") else ""
        lines += [
            f"Run at commit {machine.get('commit', '(not recorded)')}{dirty}, N={report.get('n')}, "
            f"uvloop {'on' if report.get('uvloop') else 'off'}, {report.get('wall_s', '?')} s; "
            f"load average {_load(machine.get('load_before'))} before, "
            f"{_load(machine.get('load_after'))} after.",
            "",
        ]
    lines += _noop_table(report, "rabbit") + _noop_table(report, "kafka")
    lines += _writes_table(report) + _duplicates_table(report) + _latency_table(report)
    lines += _other_tables(report)
    verdict = {True: "yes", False: "**no**", None: "-"}
    lines += ["### Targets (issue 14)", "", "| target | figure | met |", "|---|---|---|"]
    lines += [f"| {t.target} | {t.figure} | {verdict[t.met]} |" for t in targets(report)]
    return "\n".join(lines)


def _load(load: list[float] | None) -> str:
    return " / ".join(f"{x:.2f}" for x in load) if load else "?"


def merge(paths: list[str]) -> dict[str, Any]:
    """The sections of several result files in one report; a later file's sections win."""
    report: dict[str, Any] = {}
    for path in paths:
        with open(path) as results:
            part = json.load(results)
        if "memory" in part and report:
            # The main run's machine and N stay on top; the memory run's own go with it.
            report["memory"] = part["memory"]
            report["memory_run"] = {k: part.get(k) for k in ("machine", "n", "uvloop", "wall_s")}
        else:
            report.update(part)
    return report


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m bench.report RESULTS.json [MORE.json ...]")
    print(render(merge(sys.argv[1:])))
