"""Key-level tooling for operators: a key's history, stuck keys, purge, settling conflicts, and the
dead-letter replay policy every broker's admin client follows."""

from __future__ import annotations

from dedupe.operations.claims import ClaimAdmin, NotSettled
from dedupe.operations.replay import ReplayPolicy

__all__ = ["ClaimAdmin", "NotSettled", "ReplayPolicy"]
