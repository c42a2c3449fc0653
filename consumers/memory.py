"""The in-memory transport, which now lives in the core as dedupe.testing_memory (it imports no
broker client); kept importable here for the code and tests that import it from consumers."""

from __future__ import annotations

from dedupe.testing_memory import (
    MemoryBroker,
    MemoryDelivery,
    MemoryTransport,
    Sent,
    Settled,
    make_message,
)

__all__ = ["MemoryBroker", "MemoryDelivery", "MemoryTransport", "Sent", "Settled", "make_message"]
