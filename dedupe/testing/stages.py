"""Where dedupe.testing stops a run: the pipeline's stages, the crash points and stalls armed
on them, and the runs that began."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from dedupe.testing.workers import SimulatedWorker

Stage = Literal["claimed", "stepped", "handled", "completed"]
# The app hooks' stages, and "stepped": a ctx.step's function returned, its result is not
# recorded yet (dedupe.testing.steps).
STAGES: tuple[Stage, ...] = ("claimed", "stepped", "handled", "completed")
STAGE_WORDS: dict[str, str] = {
    "claimed": "after the claim",
    "stepped": "after a ctx.step's function returned, before its result was recorded",
    "handled": "after the handler returned",
    "completed": "after the completion committed, before the ack",
}


@dataclass(frozen=True, slots=True)
class Run:
    """One start of a handler on a key (its `claimed` stage), and the worker that ran it;
    `ran`: False when its worker died at the claim, before the handler was called."""

    scope: str
    key: str
    worker: str
    ran: bool = True


class Stall:
    """A run held at a stage (a zombie in the making): wait until it is there, then resume it."""

    def __init__(self, stage: Stage, key: str | None) -> None:
        self.stage = stage
        self.key = key
        self.worker: str | None = None  # the worker that stalled, once one did
        self._held: SimulatedWorker | None = None
        self._reached = asyncio.Event()
        self._resume = asyncio.Event()

    async def reached(self, timeout_s: float = 10.0) -> None:
        """Wait until a run is held at the stage."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._reached.wait()
        except TimeoutError:
            raise AssertionError(
                f"no run reached {self.stage!r} within {timeout_s:g}s"
                + (f" for key {self.key!r}" if self.key else "")
            ) from None

    async def hold(self, worker: SimulatedWorker) -> None:
        """Hold `worker`'s run here, frozen (no heartbeats), until resume() is called."""
        self.worker = worker.name
        self._held = worker
        worker.freeze()
        self._reached.set()
        try:
            await self._resume.wait()
        finally:
            worker.thaw()

    def resume(self) -> None:
        """Let the held run go on (its worker heartbeats again)."""
        if self._held is not None:
            self._held.thaw()  # at once: the run is under way from now on, for idle()
        self._resume.set()


@dataclass(eq=False)
class Point:
    """A crash point (no stall) or a stall, armed on a stage for a key (None: any)."""

    stage: Stage
    key: str | None
    stall: Stall | None
    expire_lease: bool = True


__all__ = ["STAGES", "STAGE_WORDS", "Point", "Run", "Stage", "Stall"]
