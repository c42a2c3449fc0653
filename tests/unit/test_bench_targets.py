"""The bench's verdicts (bench/targets.py: issue 26's targets) and bench.db_work's arithmetic,
computed from made-up figures: no service, no run."""

from __future__ import annotations

from typing import Any

from bench import db_work
from bench.report import render
from bench.targets import Target, targets


def latency_run(kind: str, rate: int, p50: float, p99: float) -> dict[str, Any]:
    return {
        "kind": kind,
        "target_rate": rate,
        "offered_rate": float(rate),
        "sent": 100,
        "count": 100,
        "p50_ms": p50,
        "p99_ms": p99,
    }


def report() -> dict[str, Any]:
    return {
        "commit": {"n": 100, "p50_ms": 0.4, "p99_ms": 1.0, "mean_ms": 0.5, "max_ms": 2.0},
        "cpu": {
            "rabbit": {"batch": 64, "batches": 1, "new_us": 49.0, "dup_us": 26.0, "rounds": []},
            "kafka": {"batch": 64, "batches": 4, "new_us": 51.0, "dup_us": 20.0, "rounds": []},
        },
        "throughput_kafka": {
            "kafka-raw/noop": {"rate": 30000},
            "kafka-dedupe/noop": {"rate": 8000},
            "sql-loop": {"rate": 10000},
            "kafka-naive/insert": {"rate": 500},
            "kafka-raw/insert": {"rate": 1000},
            "kafka-dedupe/insert": {"rate": 1600},
        },
        "throughput_rabbit": {
            "rabbit-raw/noop": {"rate": 3000},
            "rabbit-dedupe/noop": {"rate": 2300},
            "rabbit-naive/insert": {"rate": 500},
            "rabbit-raw/insert": {"rate": 1000},
            "rabbit-dedupe/insert": {"rate": 1400},
        },
        # RabbitMQ: 2x new keys is 5,000, 0.9x raw 2,700: 2,800 is enough. Kafka: 2x new keys
        # is 12,000 and 0.9x raw 27,000: 11,000 is not.
        "duplicates": {
            "rabbit-dedupe": {"new": 2500, "duplicates": 2800},
            "kafka-dedupe": {"new": 6000, "duplicates": 11000},
        },
        "latency": {
            "fixed_rate": 1000,
            "half_max": {"rabbit": 1150, "kafka": 4000},
            "runs": {
                # The bound is 2 x 1.0 + 5 = 7 ms over the raw p99.
                "rabbit-raw@1000": latency_run("rabbit-raw", 1000, 2.0, 5.0),
                "rabbit-dedupe@1000": latency_run("rabbit-dedupe", 1000, 3.0, 11.9),
                "rabbit-raw@1150": latency_run("rabbit-raw", 1150, 2.0, 5.0),
                "rabbit-dedupe@1150": latency_run("rabbit-dedupe", 1150, 3.0, 12.1),
                "kafka-raw@1000": latency_run("kafka-raw", 1000, 2.0, 5.0),
                "kafka-dedupe@1000": latency_run("kafka-dedupe", 1000, 3.0, 9.0),
            },
        },
    }


def verdicts(found: list[Target]) -> dict[str, bool | None]:
    return {t.target: t.met for t in found}


def find(found: dict[str, bool | None], *words: str) -> bool | None:
    [met] = [met for target, met in found.items() if all(w in target for w in words)]
    return met


def test_issue_26_verdicts() -> None:
    found = verdicts(targets(report()))
    assert find(found, "Kafka no-op", "SQL loop") is True  # 0.80x
    assert find(found, "RabbitMQ no-op") is False  # 0.77x
    assert find(found, "3x the naive", "RabbitMQ") is False  # 2.8x
    assert find(found, "3x the naive", "Kafka") is True  # 3.2x
    assert find(found, "1.5x the raw", "RabbitMQ") is False  # 1.4x
    assert find(found, "1.5x the raw", "Kafka") is True  # 1.6x
    assert find(found, "duplicates", "RabbitMQ") is True
    assert find(found, "duplicates", "Kafka") is False
    assert find(found, "p99 added", "1,000/s", "RabbitMQ") is True  # +6.9 ms
    assert find(found, "p99 added", "half of", "RabbitMQ") is False  # +7.1 ms
    assert find(found, "p99 added", "1,000/s", "Kafka") is True
    assert find(found, "p99 added", "half of", "Kafka") is None  # not run
    assert find(found, "new key <= 50", "RabbitMQ") is True
    assert find(found, "duplicate <= 25", "RabbitMQ") is False
    assert find(found, "new key <= 50", "Kafka") is False
    assert find(found, "duplicate <= 25", "Kafka") is True
    assert find(found, "memory") is None  # no memory.json


def test_latency_without_the_commit_figure_has_no_verdict() -> None:
    figures = report()
    del figures["commit"]
    found = targets(figures)
    latency = [t for t in found if t.target.startswith("p99 added")]
    assert latency and all(t.met is None for t in latency)
    assert any("commit p99 was not measured" in t.figure for t in latency)


def test_the_report_shows_the_commit_and_cpu_figures() -> None:
    text = render(report())
    assert "p99 **1.00 ms**" in text
    assert "| Kafka: 4 x 64 at once | 51.0 | 20.0 |" in text
    assert "### Targets (issue 26" in text


def test_db_work_counts_a_modifying_cte_run_after_the_top_node() -> None:
    cte = {"Node Type": "ModifyTable", "WAL Bytes": 900, "Shared Hit Blocks": 40}
    top = {"Node Type": "Hash Join", "WAL Bytes": 100, "Shared Hit Blocks": 50, "Plans": [cte]}
    counted = db_work.counts(top)
    assert counted["WAL Bytes"] == 900
    assert counted["Shared Hit Blocks"] == 50


def test_db_work_table_is_per_key_with_a_total_per_phase() -> None:
    work = [
        {"phase": "new", "statement": "claim_batch", **vars(db_work.Work(1, 500, 250_000))},
        {"phase": "new", "statement": "complete", **vars(db_work.Work(1, 500, 250_000))},
        {"phase": "duplicate", "statement": "claim_batch", **vars(db_work.Work(1, 500, 30_000))},
    ]
    result = {
        "n": 1000,
        "batch": 500,
        "every": 2,
        "postgres": "15",
        "wall_s": {"new": 0.1, "duplicate": 0.1},
        "unmeasured": [],
        "work": work,
    }
    text = db_work.table(result)
    assert "| new: claim_batch | 500 | 500.0 |" in text
    assert "| duplicate: claim_batch | 500 | 60.0 |" in text
    assert "| **new key, all statements** | 500 | 1000.0 |" in text
