"""What a worker shows of itself: Prometheus metrics, OpenTelemetry tracing, log formats, and the
activity the status page reads (duplicates suppressed, conflicts)."""

from __future__ import annotations

from dedupe.observability.activity import Activity
from dedupe.observability.metrics import Metrics
from dedupe.observability.tracing import Tracing

__all__ = ["Activity", "Metrics", "Tracing"]
