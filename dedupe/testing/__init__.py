"""dedupe.testing: prove your own handler is exactly once, in your own test suite.

    from dedupe.testing import Recorder, TestRun, check_exactly_once

    async with TestRun(app, database_url="postgresql://...") as run:   # a fresh database
        run.publish("payments", {"payment_id": "p-1"}, headers={"Idempotency-Key": "k-1"})
        await run.idle()
        assert await run.result("k-1") == {"charged": "p-1"}

    await check_exactly_once(app, "payments", body, database_url=..., effects="SELECT ...",
                             external=recorder)   # every crash point, a duplicate, a zombie

The app runs as the worker runs it (the same App object, its hooks included) with the real
claim protocol on a real PostgreSQL; only the broker is replaced by one in memory. See
docs/testing.md for what is simulated and what is not.

As a pytest plugin, `-p dedupe.testing` (or `dedupe_testing = true` in the pytest
configuration) adds the fixtures dedupe_database_url, dedupe_schema, dedupe_recorder and
dedupe_run (dedupe.testing.fixtures); installed, the plugin does nothing until so enabled.
"""

from __future__ import annotations

from dedupe.testing.check import CASES, Case, CaseResult, NotExactlyOnce, Report, check_exactly_once
from dedupe.testing.databases import (
    ClaimRow,
    Schema,
    create_database,
    drop_database,
    drop_templates,
)
from dedupe.testing.deliveries import MemoryDelivery, Sent, Settled
from dedupe.testing.memory import MemoryBroker, MemoryTransport
from dedupe.testing.recorder import Call, Recorder
from dedupe.testing.run import TestRun, current_run
from dedupe.testing.stages import Run, Stage, Stall
from dedupe.testing.workers import SimulatedWorker, WorkerDied

# Read by pytest when this module is loaded as a plugin (`-p dedupe.testing`), and only then.
pytest_plugins = ("dedupe.testing.fixtures",)

__all__ = [
    "CASES",
    "Call",
    "Case",
    "CaseResult",
    "ClaimRow",
    "MemoryBroker",
    "MemoryDelivery",
    "MemoryTransport",
    "NotExactlyOnce",
    "Recorder",
    "Report",
    "Run",
    "Schema",
    "Sent",
    "Settled",
    "SimulatedWorker",
    "Stage",
    "Stall",
    "TestRun",
    "WorkerDied",
    "check_exactly_once",
    "create_database",
    "current_run",
    "drop_database",
    "drop_templates",
]
