"""Render a bench/run.py result as Markdown: figures, ratios, and each target met or not."""

from __future__ import annotations

import json
import sys
from typing import Any


def _r(report: dict[str, Any], section: str, name: str) -> float:
    return float(report.get(section, {}).get(name, {}).get("rate", 0.0) or 0.0)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def render(report: dict[str, Any]) -> str:
    lines: list[str] = []
    targets: list[tuple[str, str, bool]] = []

    def table(title: str, section: str, names: list[str], base: str) -> None:
        if section not in report:
            return
        lines.extend(
            [
                f"### {title}",
                "",
                "| consumer | handler | msg/s | vs " + base + " |",
                "|---|---|---:|---:|",
            ]
        )
        for handler in ("noop", "insert"):
            baseline = _r(report, section, f"{base}/{handler}")
            for name in names:
                rate = _r(report, section, f"{name}/{handler}")
                lines.append(f"| {name} | {handler} | {rate:,.0f} | {_ratio(rate, baseline)} |")
        for key, value in report[section].items():
            if key.count("/") == 2:
                loop = key.rsplit("/", 1)[1]
                rate, ded = value["rate"], _r(report, section, key.rsplit("/", 1)[0])
                lines.append(
                    f"| {key.split('/')[0]} on {loop} | noop | {rate:,.0f} | "
                    f"{_ratio(ded, rate)} faster with the default loop |"
                )
        if section == "throughput_kafka" and "sql-loop" in report[section]:
            for key in sorted(k for k in report[section] if k.startswith("sql-loop-")):
                rate = _r(report, section, key)
                size = key.removeprefix("sql-loop-").replace("x", " keys x ") + " loops"
                lines.append(f"| bare claim+complete SQL loop ({size}) | - | {rate:,.0f} | - |")
        lines.append("")

    table(
        "RabbitMQ throughput (backlog, one process)",
        "throughput_rabbit",
        ["rabbit-raw", "rabbit-dedupe", "rabbit-naive", "rabbit-faststream"],
        "rabbit-raw",
    )
    table(
        "Kafka throughput (backlog, one process, 4 partitions)",
        "throughput_kafka",
        ["kafka-raw", "kafka-dedupe", "kafka-naive"],
        "kafka-raw",
    )

    if "throughput_rabbit" in report:
        for handler in ("noop", "insert"):
            d = _r(report, "throughput_rabbit", f"rabbit-dedupe/{handler}")
            raw = _r(report, "throughput_rabbit", f"rabbit-raw/{handler}")
            naive = _r(report, "throughput_rabbit", f"rabbit-naive/{handler}")
            fs = _r(report, "throughput_rabbit", f"rabbit-faststream/{handler}")
            targets.append(
                (
                    f"RabbitMQ >= 0.8x raw aio-pika ({handler})",
                    f"{_ratio(d, raw)} ({d:,.0f} vs {raw:,.0f}/s)",
                    raw > 0 and d >= 0.8 * raw,
                )
            )
            targets.append(
                (
                    f"RabbitMQ >= 2x naive ({handler})",
                    f"{_ratio(d, naive)} ({d:,.0f} vs {naive:,.0f}/s); FastStream naive "
                    f"{fs:,.0f}/s",
                    naive > 0 and d >= 2 * naive,
                )
            )
    if "throughput_kafka" in report:
        loop = _r(report, "throughput_kafka", "sql-loop")
        for handler in ("noop", "insert"):
            d = _r(report, "throughput_kafka", f"kafka-dedupe/{handler}")
            naive = _r(report, "throughput_kafka", f"kafka-naive/{handler}")
            targets.append(
                (f"Kafka >= 20,000 msg/s per process ({handler})", f"{d:,.0f}/s", d >= 20_000)
            )
            targets.append(
                (
                    f"Kafka >= 0.8x bare SQL loop ({handler})",
                    f"{_ratio(d, loop)} ({d:,.0f} vs {loop:,.0f}/s)",
                    loop > 0 and d >= 0.8 * loop,
                )
            )
            targets.append(
                (
                    f"Kafka >= 5x naive ({handler})",
                    f"{_ratio(d, naive)} ({d:,.0f} vs {naive:,.0f}/s)",
                    naive > 0 and d >= 5 * naive,
                )
            )

    if "duplicates" in report:
        lines.extend(
            [
                "### Replays: a stream of nothing but duplicates",
                "",
                "| worker | new keys msg/s | duplicates msg/s | ratio |",
                "|---|---:|---:|---:|",
            ]
        )
        for kind, v in report["duplicates"].items():
            lines.append(
                f"| {kind} | {v['new']:,.0f} | {v['duplicates']:,.0f} | "
                f"{_ratio(v['duplicates'], v['new'])} |"
            )
            targets.append(
                (
                    f"duplicates >= 2x new ({kind})",
                    _ratio(v["duplicates"], v["new"]),
                    v["new"] > 0 and v["duplicates"] >= 2 * v["new"],
                )
            )
        lines.append("")

    if "latency" in report:
        lines.extend(
            [
                "### Latency at half of dedupe-worker's maximum (publish to settled)",
                "",
                "| consumer | rate | p50 ms | p99 ms | samples |",
                "|---|---:|---:|---:|---:|",
            ]
        )
        lat = report["latency"]
        for kind, v in lat.items():
            lines.append(
                f"| {kind} | {v['target_rate']:,}/s | {v['p50_ms']} | {v['p99_ms']} | "
                f"{v['latency_samples']} |"
            )
        for broker in ("rabbit", "kafka"):
            raw, ded = lat.get(f"{broker}-raw"), lat.get(f"{broker}-dedupe")
            if raw and ded and raw["p99_ms"] is not None and ded["p99_ms"] is not None:
                added = ded["p99_ms"] - raw["p99_ms"]
                targets.append(
                    (
                        f"p99 added latency <= 10 ms at half load ({broker})",
                        f"{added:+.1f} ms (p99 {ded['p99_ms']} vs raw {raw['p99_ms']})",
                        added <= 10,
                    )
                )
        lines.append("")

    if "gc" in report:
        g = report["gc"]
        lines.extend(
            [
                "### Clean-up of expired claims while the worker runs",
                "",
                f"- {g['deleted']:,} of {g['expired']:,} expired claims deleted at "
                f"**{g['gc_rate']:,} rows/s** of clean-up time; "
                f"{g['deleted_while_worker_ran']:,} of them while the worker ran at "
                f"{g['worker_rate']:,.0f} msg/s",
                "",
            ]
        )

    if "workers" in report:
        lines.extend(
            [
                "### Worker processes (no-op handler, rate from the claims' timestamps)",
                "",
                "| worker | 1 | 2 | 4 |",
                "|---|---:|---:|---:|",
            ]
        )
        for kind in ("rabbit-dedupe", "kafka-dedupe"):
            cells = [report["workers"].get(f"{kind}/{c}", {}).get("rate", 0) for c in (1, 2, 4)]
            lines.append(f"| {kind} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
        lines.append("")

    if "memory" in report:
        m = report["memory"]
        samples = m["rss_mb"]
        lines.extend(
            [
                "### Resident memory of one Kafka worker",
                "",
                f"- {m['n']:,} messages at {m['rate']:,.0f} msg/s; RSS max "
                f"{max(s[2] for s in samples)} MB",
                "- samples (s, messages, MB): "
                + ", ".join(
                    f"({t}, {c}, {mb})" for t, c, mb in samples[:: max(1, len(samples) // 12)]
                ),
                "",
            ]
        )
        first = [s[2] for s in samples if s[1] > 0][:3] or [0]
        grow = max(s[2] for s in samples) - min(first)
        targets.append(
            (
                "memory flat and < 200 MB over the run",
                f"max {max(s[2] for s in samples)} MB, growth {grow:+.1f} MB after start",
                max(s[2] for s in samples) < 200 and grow < 30,
            )
        )

    if "outbox" in report:
        lines.extend(
            [
                "### A handler that publishes one message: through the outbox against directly",
                "",
                "| worker | direct (confirmed before the handler returns) msg/s | outbox: "
                "handled msg/s | outbox: relayed (last one confirmed) msg/s | relayed vs "
                "direct |",
                "|---|---:|---:|---:|---:|",
            ]
        )
        for kind in ("rabbit-dedupe", "kafka-dedupe"):
            direct = _r(report, "outbox", f"{kind}/direct")
            handled = _r(report, "outbox", f"{kind}/outbox")
            relayed = float(
                report["outbox"].get(f"{kind}/outbox", {}).get("relayed_rate", 0.0) or 0.0
            )
            if not direct and not relayed:
                continue
            lines.append(
                f"| {kind} | {direct:,.0f} | {handled:,.0f} | {relayed:,.0f} | "
                f"{_ratio(relayed, direct)} |"
            )
            targets.append(
                (
                    f"a publish through the outbox >= 0.7x a direct one ({kind})",
                    f"{_ratio(relayed, direct)} ({relayed:,.0f} vs {direct:,.0f}/s)",
                    direct > 0 and relayed >= 0.7 * direct,
                )
            )
        lines.append("")

    if targets:
        lines.extend(["### Targets", "", "| target | figure | met |", "|---|---|---|"])
        lines.extend(f"| {t} | {fig} | {'yes' if ok else '**no**'} |" for t, fig, ok in targets)
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as results:
        print(render(json.load(results)))
