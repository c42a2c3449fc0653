"""The Recorder: the calls a fake external client makes (a payment API, an e-mail sender), with
the idempotency key each carried, and the simulated worker that made it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dedupe.testing.workers import current_worker


@dataclass(frozen=True, slots=True)
class Call:
    """One call to an external system; `key` is the idempotency key it carried (None: none)."""

    key: str | None
    what: Mapping[str, Any]
    worker: str | None  # the simulated worker that made it (None: outside any test run)

    def describe(self) -> str:
        what = " ".join(f"{name}={value!r}" for name, value in self.what.items())
        key = "no key" if self.key is None else repr(self.key)
        by = f" by worker {self.worker}" if self.worker else ""
        return f"{key}{by}" + (f": {what}" if what else "")


class Recorder:
    """Records external calls with their idempotency keys; a fake client calls `record`.

    recorder = Recorder()

    class FakePayments:
        async def charge(self, *, idempotency_key: str, amount_cents: int) -> str:
            recorder.record(idempotency_key, amount_cents=amount_cents)
            return f"ch_{idempotency_key}"
    """

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def record(self, key: str | None, /, **what: Any) -> None:
        """Record a call made with idempotency key `key` (None: the call carried none)."""
        worker = current_worker()
        self.calls.append(
            Call(None if key is None else str(key), dict(what), worker.name if worker else None)
        )

    def keys(self) -> list[str | None]:
        """The keys the calls carried, each once, in the order first seen."""
        return list(dict.fromkeys(call.key for call in self.calls))

    def clear(self) -> None:
        self.calls.clear()

    def __len__(self) -> int:
        return len(self.calls)

    def __repr__(self) -> str:
        return f"Recorder({len(self.calls)} calls, {len(self.keys())} keys)"


def distinct_keys(calls: list[Call]) -> int:
    """How many different keys the calls carried; a call without a key counts on its own (the
    other side cannot tell its repeat from a new call)."""
    keyed = {call.key for call in calls if call.key is not None}
    return len(keyed) + sum(call.key is None for call in calls)


__all__ = ["Call", "Recorder", "distinct_keys"]
