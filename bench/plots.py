"""PNG plots of bench/run.py results (matplotlib, headless), written beside the JSON.

    .venv/bin/python -m bench.plots bench/results/latest.json [memory.json] [--out DIR]

- latency.png: p50 and p99 (publish to settled) against the offered rate, the raw client and
  dedupe-worker on each broker, with the target (raw p99 + 10 ms) and the two target rates;
- throughput.png: msg/s per scenario as bars (no-op, handlers that write, replays), each bar
  with its ratio to the scenario's baseline and, for dedupe-worker, the target it must reach;
- memory.png: RSS against messages settled, from `make bench-memory`.

Log scales: the rates span 1,000 to 100,000+ msg/s and the latencies 1 ms to seconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: the bench machines have no display

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from bench import targets as figures
from bench.report import merge

COLORS = {
    "raw": "#6b6b6b",
    "naive": "#d62728",
    "faststream": "#ff7f0e",
    "dedupe": "#1f77b4",
    "insert-group": "#08306b",
    "target": "#2ca02c",
}
THOUSANDS = FuncFormatter(lambda value, _: f"{value:,.0f}")


def _subtitle(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    load = machine.get("load_before") or [0.0]
    dirty = "+changes" if machine.get("dirty") else ""
    return (
        f"commit {machine.get('commit', 'not recorded')}{dirty}, N={report.get('n', '?'):,}, "
        f"load {load[0]:.1f} at start, {machine.get('cpus', '?')} CPUs shared with the brokers "
        "and PostgreSQL"
    )


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _offered(run: dict[str, Any], target: int) -> float:
    """The rate the load generator reached in `run` (earlier runs did not record it)."""
    return float(run.get("offered_rate") or target)


def plot_latency(report: dict[str, Any], path: Path) -> Path | None:
    """p50/p99 against offered rate, raw and dedupe-worker, one panel per broker."""
    runs = figures.latency_runs(report)
    if not any(runs.values()):
        return None
    halves = figures.half_max(report)
    fixed = report.get("latency", {}).get("fixed_rate")
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), layout="constrained")
    for ax, (broker, name) in zip(axes, figures.BROKERS.items(), strict=True):
        points = runs[broker]
        for consumer, label in (("raw", "raw client"), ("dedupe", "dedupe-worker")):
            for pct, style, marker in (("p99_ms", "-", "o"), ("p50_ms", "--", "s")):
                rates = [r for r in sorted(points) if (points[r].get(consumer) or {}).get(pct)]
                # At the rate the load generator reached: short of the target, the point says so.
                xs = [_offered(points[r][consumer], r) for r in rates]
                ys = [points[r][consumer][pct] for r in rates]
                ax.plot(
                    xs, ys, style, marker=marker, color=COLORS[consumer], label=f"{label} {pct[:3]}"
                )
                behind = [
                    (x, y)
                    for r, x, y in zip(rates, xs, ys, strict=True)
                    if not figures.settled_all(points[r][consumer])
                ]
                if behind:
                    ax.scatter(
                        *zip(*behind, strict=True),
                        s=140,
                        facecolors="none",
                        edgecolors="black",
                        zorder=3,
                    )
        raw = [r for r in sorted(points) if (points[r].get("raw") or {}).get("p99_ms")]
        bound = figures.added_p99_bound(report)
        if bound is not None:
            ax.plot(
                [_offered(points[r]["raw"], r) for r in raw],
                [points[r]["raw"]["p99_ms"] + bound for r in raw],
                ":",
                color=COLORS["target"],
                lw=2,
                label=f"target: raw p99 + {bound:.1f} ms (2 x commit p99 + 5 ms)",
            )
        for label, offered in (("half max", halves.get(broker)), ("target 1,000/s", fixed)):
            if offered:
                ax.axvline(offered, color="0.75", lw=1, zorder=0)
                ax.annotate(
                    label,
                    (offered, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, -12),
                    textcoords="offset points",
                    fontsize=8,
                    color="0.4",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sorted(points))
        ax.xaxis.set_major_formatter(THOUSANDS)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("offered rate (msg/s, log scale)")
        ax.set_ylabel("publish → settled (ms, log scale)")
        ax.set_title(f"{name} (raw client: {figures.RAW_CLIENT[broker]})")
        ax.grid(True, which="both", alpha=0.25)
    # One legend below both panels: inside, it would hide the low-rate points.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=5, fontsize=8)
    fig.suptitle(
        "Latency against offered rate, no-op handler; each point at the rate the load generator"
        " reached (circled: not all settled)\n" + _subtitle(report),
        fontsize=10,
    )
    return _save(fig, path)


# One bar per row: (scenario, consumer key of throughput_<broker>, label, color, baseline key).
Row = tuple[str, str, str, str, str | None]


def _rows(broker: str) -> list[Row]:
    raw, naive = f"{broker}-raw", f"{broker}-naive"
    return [
        ("no-op", f"{raw}/noop", f"raw {figures.RAW_CLIENT[broker]}", "raw", None),
        ("no-op", f"{broker}-dedupe/noop", "dedupe-worker", "dedupe", f"{raw}/noop"),
        ("no-op", f"{naive}/noop", "naive consumer", "naive", f"{raw}/noop"),
        (
            "no-op",
            f"{broker}-faststream/noop",
            "FastStream + naive check",
            "faststream",
            f"{raw}/noop",
        ),
        ("insert", f"{raw}/insert", "raw client + INSERT", "raw", f"{naive}/insert"),
        ("insert", f"{naive}/insert", "naive consumer + row", "naive", None),
        (
            "insert",
            f"{broker}-faststream/insert",
            "FastStream + row",
            "faststream",
            f"{naive}/insert",
        ),
        (
            "insert",
            f"{broker}-dedupe/insert",
            "dedupe-worker, commit per message",
            "dedupe",
            f"{naive}/insert",
        ),
        (
            "insert",
            f"{broker}-dedupe/insert-group",
            "dedupe-worker, group commit",
            "insert-group",
            f"{naive}/insert",
        ),
        ("replay", "new", "dedupe-worker, new keys", "dedupe", None),
        ("replay", "duplicates", "dedupe-worker, duplicates", "insert-group", "new"),
    ]


def _targets(broker: str, rates: dict[str, float]) -> dict[str, float]:
    """The rate each dedupe-worker bar must reach, where the issue sets one."""
    out: dict[str, float] = {}
    if f"{broker}-raw/noop" in rates and broker == "rabbit":
        out["rabbit-dedupe/noop"] = figures.RABBIT_NOOP_VS_RAW * rates["rabbit-raw/noop"]
    if broker == "kafka" and rates.get("sql-loop"):
        out["kafka-dedupe/noop"] = figures.KAFKA_NOOP_VS_SQL_LOOP * rates["sql-loop"]
    naive, raw = rates.get(f"{broker}-naive/insert"), rates.get(f"{broker}-raw/insert")
    if naive and raw:
        need = max(figures.WRITES_VS_NAIVE * naive, figures.WRITES_VS_RAW * raw)
        out[f"{broker}-dedupe/insert"] = out[f"{broker}-dedupe/insert-group"] = need
    if rates.get("new") and rates.get(f"{broker}-raw/noop"):
        out["duplicates"] = min(
            figures.DUPLICATES_VS_NEW * rates["new"],
            figures.DUPLICATES_VS_RAW * rates[f"{broker}-raw/noop"],
        )
    return out


def _bars(ax: Axes, broker: str, report: dict[str, Any]) -> bool:
    section = report.get(f"throughput_{broker}", {})
    rates = {k: float(v["rate"]) for k, v in section.items() if v.get("rate")}
    dup = report.get("duplicates", {}).get(f"{broker}-dedupe")
    if dup:
        rates.update(new=float(dup["new"]), duplicates=float(dup["duplicates"]))
    rows = [r for r in _rows(broker) if r[1] in rates]
    if not rows:
        ax.set_visible(False)
        return False
    targets = _targets(broker, rates)
    ys: list[float] = []
    y, previous = 0.0, rows[0][0]
    headings: list[tuple[float, str]] = [(-0.9, rows[0][0])]
    for scenario, *_ in rows:
        if scenario != previous:
            y += 1.2  # a gap and a heading between scenarios
            headings.append((y - 0.9, scenario))
            previous = scenario
        ys.append(y)
        y += 1
    values = [rates[r[1]] for r in rows]
    bars = ax.barh(ys, values, color=[COLORS[r[3]] for r in rows], height=0.7)
    labels = []
    for (*_, base), value in zip(rows, values, strict=True):
        text = f"{value:,.0f}/s"
        if base and rates.get(base):
            # "rabbit-naive/insert" -> "naive"; the replay's baseline is the new keys' run.
            what = "new keys" if base == "new" else base.split("/")[0].split("-", 1)[1]
            text += f"  {value / rates[base]:.2f}x {what}"
        labels.append(text)
    ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
    marked = False
    for yy, (_, key, *_rest) in zip(ys, rows, strict=True):
        if key in targets:
            # A marker above the bar, clear of the value label at its end.
            ax.plot(
                targets[key],
                yy - 0.5,
                "v",
                color=COLORS["target"],
                markersize=8,
                label=None if marked else "target (dedupe-worker)",
            )
            marked = True
    for yy, scenario in headings:
        title = {
            "no-op": "no-op handler",
            "insert": "handlers that write (one row)",
            "replay": "replays",
        }[scenario]
        ax.text(
            0.0,
            yy,
            title,
            transform=ax.get_yaxis_transform(),
            fontsize=9,
            fontweight="bold",
            va="center",
        )
    ax.set_yticks(ys, [r[2] for r in rows], fontsize=8)
    ax.set_ylim(ys[-1] + 0.8, -1.6)  # inverted: the first row on top, room for its heading
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 2, max(max(values), *targets.values()) * 6)
    ax.xaxis.set_major_formatter(THOUSANDS)
    ax.set_xlabel("messages per second (log scale; backlog, one worker process)")
    ax.set_title(figures.BROKERS[broker])
    ax.grid(True, axis="x", which="major", alpha=0.25)
    return True


def plot_throughput(report: dict[str, Any], path: Path) -> Path | None:
    """Throughput per scenario as bars, one panel per broker."""
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), layout="constrained")
    drawn = [_bars(ax, broker, report) for ax, broker in zip(axes, figures.BROKERS, strict=True)]
    if not any(drawn):
        plt.close(fig)
        return None
    # Below the panels: inside one, the legend would cover the value labels of the last bars.
    marks = [h for ax in axes for h in ax.get_legend_handles_labels()[0]][:1]
    if marks:
        fig.legend(marks, ["target (dedupe-worker)"], loc="outside lower center", fontsize=8)
    fig.suptitle(
        f"Throughput per scenario (ratio to the scenario's baseline)\n{_subtitle(report)}",
        fontsize=10,
    )
    return _save(fig, path)


def plot_memory(report: dict[str, Any], path: Path) -> Path | None:
    """RSS of one Kafka worker against messages settled, with the 200 MB limit."""
    samples = report.get("memory", {}).get("rss_mb")
    if not samples:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    ax.plot(
        [s[1] for s in samples],
        [s[2] for s in samples],
        marker=".",
        color=COLORS["dedupe"],
        label="dedupe-worker RSS",
    )
    ax.axhline(figures.MEMORY_MB, color=COLORS["target"], ls=":", lw=2, label="limit: 200 MB")
    ax.set_ylim(0, figures.MEMORY_MB * 1.15)
    ax.xaxis.set_major_formatter(THOUSANDS)
    ax.set_xlabel("messages settled")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title(
        f"One Kafka worker over {report['memory']['n']:,} messages\n"
        + _subtitle(report.get("memory_run", report)),
        fontsize=10,
    )
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


PLOTS: dict[str, Callable[[dict[str, Any], Path], Path | None]] = {
    "latency.png": plot_latency,
    "throughput.png": plot_throughput,
    "memory.png": plot_memory,
}


def plot_report(report: dict[str, Any], directory: Path) -> list[Path]:
    """Write the plots whose scenarios are in `report` into `directory`; their paths."""
    written = [plot(report, directory / name) for name, plot in PLOTS.items()]
    return [path for path in written if path is not None]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="result files, merged as bench.report does")
    parser.add_argument("--out", help="folder for the PNGs (default: beside the first file)")
    args = parser.parse_args()
    out = Path(args.out or Path(args.results[0]).parent)
    out.mkdir(parents=True, exist_ok=True)
    for png in plot_report(merge(args.results), out):
        print(png)
