"""Issue 26's targets (and issue 16's outbox target) as numbers, and the figures and verdicts
that bench/report.py and bench/plots.py compute from a bench/run.py report. Every target is a
ratio to a baseline measured in the same run (or, for CPU and memory, an absolute bound)."""

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

# issue 26's targets, as numbers the verdicts use.
# p99 added over the raw client at most ADDED_P99_COMMITS x the run's commit p99 + ADDED_P99_MS.
ADDED_P99_COMMITS = 2.0
ADDED_P99_MS = 5.0
WRITES_VS_NAIVE = 3.0
WRITES_VS_RAW = 1.5
KAFKA_NOOP_VS_SQL_LOOP = 0.8  # the bare claim+complete SQL loop of the same run
RABBIT_NOOP_VS_RAW = 0.8
DUPLICATES_VS_NEW = 2.0  # duplicates >= min(2x the new keys, 0.9x the raw client)
DUPLICATES_VS_RAW = 0.9
CPU_NEW_US = 50.0  # bench.core: CPU per message, new keys
CPU_DUP_US = 25.0  # bench.core: CPU per message, duplicates
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


def commit_p99(report: dict[str, Any]) -> float | None:
    """The run's durable single-row INSERT p99 in ms (bench.commit), None if not measured."""
    p99 = report.get("commit", {}).get("p99_ms")
    return float(p99) if p99 is not None else None


def added_p99_bound(report: dict[str, Any]) -> float | None:
    """What dedupe-worker's p99 may add over the raw client's: 2 x commit p99 + 5 ms."""
    p99 = commit_p99(report)
    return ADDED_P99_COMMITS * p99 + ADDED_P99_MS if p99 is not None else None


def latency_targets(report: dict[str, Any]) -> list[Target]:
    runs = latency_runs(report)
    halves = half_max(report)
    fixed = report.get("latency", {}).get("fixed_rate")
    bound = added_p99_bound(report)
    commit = commit_p99(report)
    out: list[Target] = []
    for broker, name in BROKERS.items():
        for label, at in (("1,000/s", fixed), ("half of the maximum", halves.get(broker))):
            how = (
                f"{ADDED_P99_COMMITS:g} x commit p99 {commit:.1f} + {ADDED_P99_MS:g} = {bound:.1f}"
                if bound is not None and commit is not None
                else f"{ADDED_P99_COMMITS:g} x commit p99 + {ADDED_P99_MS:g}"
            )
            target = f"p99 added over the raw client <= {how} ms at {label}, {name}"
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
            if bound is None:
                figure += "; the commit p99 was not measured in this run (`commit`)"
            met = None if slow or bound is None else not behind and added <= bound
            out.append(Target(target, figure, met))
    return out


def throughput_targets(report: dict[str, Any]) -> list[Target]:
    """The no-op handlers against their baselines, then one `ctx.db` insert against its two."""
    out: list[Target] = []
    kafka = rate(report, "kafka", "kafka-dedupe/noop")
    loop = rate(report, "kafka", "sql-loop")
    out.append(
        Target(
            f"Kafka no-op >= {KAFKA_NOOP_VS_SQL_LOOP:g}x the bare claim+complete SQL loop",
            f"{ratio(kafka, loop)} ({kafka:,.0f} vs {loop:,.0f}/s)"
            if kafka is not None and loop
            else "not measured in this run",
            kafka >= KAFKA_NOOP_VS_SQL_LOOP * loop if kafka is not None and loop else None,
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
    for broker, name in BROKERS.items():
        how, ded = writes_figure(report, broker)
        single = rate(report, broker, f"{broker}-dedupe/insert")
        for base, times in (("naive", WRITES_VS_NAIVE), ("raw", WRITES_VS_RAW)):
            target = f"one `ctx.db` insert >= {times:g}x {WRITE_BASES[base]}, {name}"
            other = rate(report, broker, f"{broker}-{base}/insert")
            if ded is None or not other:
                out.append(Target(target, "not measured in this run", None))
                continue
            figure = f"{how} {ratio(ded, other)} ({ded:,.0f} vs {other:,.0f}/s)"
            if how == "group commit" and single is not None:
                figure += f"; one commit per message {ratio(single, other)}"
            out.append(Target(target, figure, ded >= times * other))
    return out


def duplicate_targets(report: dict[str, Any]) -> list[Target]:
    out: list[Target] = []
    for broker, name in BROKERS.items():
        target = (
            f"duplicates >= min({DUPLICATES_VS_NEW:g}x the rate of new keys, "
            f"{DUPLICATES_VS_RAW:g}x the raw client), {name}"
        )
        v = report.get("duplicates", {}).get(f"{broker}-dedupe")
        if not v or not v["new"]:
            out.append(Target(target, "not measured in this run", None))
            continue
        dup, new = float(v["duplicates"]), float(v["new"])
        raw = rate(report, broker, f"{broker}-raw/noop")
        figure = f"{ratio(dup, new)} the new keys ({dup:,.0f} vs {new:,.0f}/s)"
        if not raw:
            out.append(Target(target, figure + "; the raw client not run", None))
            continue
        figure += f", {ratio(dup, raw)} the raw client ({raw:,.0f}/s)"
        need = min(DUPLICATES_VS_NEW * new, DUPLICATES_VS_RAW * raw)
        out.append(Target(target, figure, dup >= need))
    return out


def cpu_targets(report: dict[str, Any]) -> list[Target]:
    """bench.core's CPU per message, with each broker's batch shape (bench.run's `core`)."""
    out: list[Target] = []
    for broker, name in BROKERS.items():
        run = report.get("cpu", {}).get(broker)
        for kind, words, bound in (
            ("new", "new key", CPU_NEW_US),
            ("dup", "duplicate", CPU_DUP_US),
        ):
            target = f"CPU per message (bench.core), {words} <= {bound:g} us, {name} batches"
            got = (run or {}).get(f"{kind}_us")
            if got is None:
                out.append(Target(target, "not measured in this run", None))
                continue
            figure = f"{got:.1f} us/msg ({run['batches']} x {run['batch']} messages at once)"
            out.append(Target(target, figure, got <= bound))
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
    """Every issue-26 target, in the issue's order, then issue 16's outbox target, each with its
    figure from `report`."""
    return [
        *throughput_targets(report),
        *duplicate_targets(report),
        *latency_targets(report),
        *cpu_targets(report),
        memory_target(report),
        *outbox_targets(report),
    ]
