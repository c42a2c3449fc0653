"""What a benchmark consumer counts: settled messages, the first and last times, latencies of
timed bodies and RSS samples (bench/worker.py prints its report as one JSON line)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import psutil


class Tally:
    """Counts settled messages, remembers first/last times, latencies and RSS samples."""

    def __init__(self, n: int, stop: asyncio.Event, *, rss_every_s: float) -> None:
        self.n = n
        self.stop = stop
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.latencies: list[float] = []
        # BENCH_LATENCY_TIMELINE=<file>: every settle's (time, latency), written at the end, to
        # tell a queue that grows from stalls that come and go.
        self.timeline: list[tuple[float, float]] | None = (
            [] if os.environ.get("BENCH_LATENCY_TIMELINE") else None
        )
        self.rss: list[tuple[float, int, float]] = []  # (t, count, MB)
        self.rss_every_s = rss_every_s
        self._proc = psutil.Process()

    def arrived(self) -> None:
        if self.first is None:
            self.first = time.time()

    def settled(self, body: bytes | None = None, k: int = 1) -> None:
        now = time.time()
        if body is not None and body[:1] == b"t":
            self.latencies.append(now - float(body[1:18]))
            if self.timeline is not None:
                self.timeline.append((now, self.latencies[-1]))
        self.count += k
        self.last = now
        if self.n and self.count >= self.n:
            self.stop.set()

    async def sample_rss(self) -> None:
        start = time.time()
        while self.rss_every_s > 0:
            mb = self._proc.memory_info().rss / 2**20
            self.rss.append((round(time.time() - start, 1), self.count, round(mb, 1)))
            await asyncio.sleep(self.rss_every_s)

    def report(self, **extra: Any) -> dict[str, Any]:
        if self.timeline:
            Path(os.environ["BENCH_LATENCY_TIMELINE"]).write_text(
                "".join(f"{t:.4f} {latency:.4f}\n" for t, latency in self.timeline)
            )
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else None

        return {
            "count": self.count,
            "first": self.first,
            "last": self.last,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "latency_samples": len(lat),
            "rss_mb": self.rss,
            "max_rss_mb": round(self._proc.memory_info().rss / 2**20, 1),
            **extra,
        }
