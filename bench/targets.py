"""The issue-14 (and issue-16 outbox) targets as numbers, and the figures and verdicts that
bench/report.py and bench/plots.py compute from a bench/run.py report."""

from __future__ import annotations

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


OUTBOX_VS_DIRECT = 0.7  # issue 16's bench: a publish through the outbox against a direct one
OUTBOX_KINDS = {"rabbit": "rabbit-dedupe", "kafka": "kafka-dedupe"}


def outbox_rates(report: dict[str, Any], broker: str) -> tuple[float, float, float]:
    """(direct, handled through the outbox, relayed through the outbox) msg/s of one broker."""
    section = report.get("outbox", {})
    kind = OUTBOX_KINDS[broker]
    direct = float(section.get(f"{kind}/direct", {}).get("rate") or 0.0)
    run = section.get(f"{kind}/outbox", {})
    return direct, float(run.get("rate") or 0.0), float(run.get("relayed_rate") or 0.0)


def outbox_targets(report: dict[str, Any]) -> list[Target]:
    out = []
    for broker, name in BROKERS.items():
        target = f"{name}: a publish through the outbox >= {OUTBOX_VS_DIRECT}x a direct one"
        direct, _, relayed = outbox_rates(report, broker)
        if not direct:
            out.append(Target(target, "not measured in this run", None))
            continue
        figure = f"{ratio(relayed, direct)} ({relayed:,.0f} vs {direct:,.0f} msg/s)"
        out.append(Target(target, figure, relayed >= OUTBOX_VS_DIRECT * direct))
    return out


def targets(report: dict[str, Any]) -> list[Target]:
    """Every issue-14 target, in the issue's order, then issue 16's outbox target, each with its
    figure from `report`."""
    return [
        *latency_targets(report),
        *throughput_targets(report),
        *duplicate_targets(report),
        memory_target(report),
        *outbox_targets(report),
    ]
