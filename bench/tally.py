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
        # The process's CPU time (user + system) at the first arrival and at the n-th settle:
        # CPU per message under load, which the machine's other work disturbs far less than
        # the rate.
        self.cpu_first: float | None = None
        self.cpu_last: float | None = None
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
            self.cpu_first = time.process_time()

    def settled(self, body: bytes | None = None, k: int = 1) -> None:
        now = time.time()
        if body is not None and body[:1] == b"t":
            self.latencies.append(now - float(body[1:18]))
            if self.timeline is not None:
                self.timeline.append((now, self.latencies[-1]))
        self.count += k
        self.last = now
        if self.n and self.count >= self.n:
            if self.cpu_last is None:
                self.cpu_last = time.process_time()
            self.stop.set()

    def cpu_us_per_msg(self) -> float | None:
        """The consumer process's CPU per settled message, from the first arrival to the n-th."""
        if self.cpu_first is None or self.cpu_last is None or not self.count:
            return None
        return round((self.cpu_last - self.cpu_first) / self.count * 1e6, 1)

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
            "cpu_us_per_msg": self.cpu_us_per_msg(),
            "rss_mb": self.rss,
            "max_rss_mb": round(self._proc.memory_info().rss / 2**20, 1),
            **extra,
        }
