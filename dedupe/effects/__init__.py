"""What a run does beyond its return value, committed with its outcome: the transactional outbox
(`ctx.publish`, relayed with confirms) and durable steps (`ctx.step`)."""

from __future__ import annotations

from dedupe.effects.outbox import Outgoing, Relay
from dedupe.effects.run_effects import RunEffects, StepError

__all__ = ["Outgoing", "Relay", "RunEffects", "StepError"]
