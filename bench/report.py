"""Render bench/run.py results as Markdown: figures, ratios, and each issue-26 target met or not.

    .venv/bin/python -m bench.report bench/results/latest.json [bench/results/memory.json]

Several files are merged (a later one's sections win), so the memory run of `make bench-memory`
joins the Targets table. Every verdict is computed from the figures; a target whose scenario is
not in the files says so instead of a verdict. Also reads the results of earlier runs (their
latency scenario measured half load alone).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.targets import (
    BROKERS,
    LABELS,
    RAW_CLIENT,
    half_max,
    latency_runs,
    outbox_rates,
    rate,
    ratio,
    settled_all,
    short_of_rate,
    targets,
)


def _outbox_table(report: dict[str, Any]) -> list[str]:
    rows = []
    for broker, name in BROKERS.items():
        direct, handled, relayed = outbox_rates(report, broker)
        if direct or relayed:
            rows.append(
                f"| {name} | {direct:,.0f} | {handled:,.0f} | {relayed:,.0f} | "
                f"{ratio(relayed, direct)} |"
            )
    if not rows:
        return []
    return [
        "#### A handler that publishes one message: through the outbox against directly",
        "",
        "| broker | direct (confirmed before the handler returns) msg/s | outbox: handled msg/s "
        "| outbox: relayed (last one confirmed) msg/s | relayed vs direct |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def _baseline_table(report: dict[str, Any]) -> list[str]:
    """The machine's durable commit and bench.core's CPU per message, measured in the run."""
    lines: list[str] = []
    c = report.get("commit")
    if c:
        lines += [
            "#### The machine's durable commit (a single-row INSERT alone, `synchronous_commit` "
            f"{c.get('synchronous_commit', 'on')})",
            "",
            f"- {c['n']:,} commits one after the other: p50 **{c['p50_ms']:.2f} ms**, "
            f"p99 **{c['p99_ms']:.2f} ms** (mean {c['mean_ms']:.2f}, max {c['max_ms']:.2f})",
            "",
        ]
    cpu = report.get("cpu")
    if cpu:
        lines += [
            "#### CPU per message in the pipeline alone (`bench.core`, no broker)",
            "",
            "| batch shape | new keys us/msg | duplicates us/msg | new msg/s | duplicates msg/s |",
            "|---|---:|---:|---:|---:|",
        ]
        for broker, name in BROKERS.items():
            run = cpu.get(broker)
            if not run:
                continue
            rounds = {r["kind"]: r for r in run.get("rounds", [])}
            rates = [f"{rounds[k]['msg_per_s']:,}" if k in rounds else "-" for k in ("new", "dup")]
            lines.append(
                f"| {name}: {run['batches']} x {run['batch']} at once | {run['new_us']:.1f} | "
                f"{run['dup_us']:.1f} | {rates[0]} | {rates[1]} |"
            )
        lines.append("")
    return lines


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
    lines += _baseline_table(report)
    lines += _noop_table(report, "rabbit") + _noop_table(report, "kafka")
    lines += _writes_table(report) + _duplicates_table(report) + _latency_table(report)
    lines += _other_tables(report) + _outbox_table(report)
    verdict = {True: "yes", False: "**no**", None: "-"}
    lines += [
        "### Targets (issue 26; the outbox: issue 16)",
        "",
        "| target | figure | met |",
        "|---|---|---|",
    ]
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
