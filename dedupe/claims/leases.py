"""The claims a worker holds, from the claim to the outcome: heartbeated while they wait for a
runner and while they run, cancelled when taken over, given back at a graceful stop. The
heartbeat (HeldLeases) is the HTTP middleware's too."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from dedupe.claims.records import Fence, KeyId
from dedupe.claims.store import ClaimStore
from dedupe.claims.verdicts import Ours
from dedupe.errors import StoreError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Lease:
    """A claim we hold. Its run's task is set once a runner takes it; the heartbeat extends
    it, and cancels the run (or, while it waits, marks it lost) when another worker took it."""

    fence: Fence
    lease_s: float
    attempt: int  # the attempt number the claims table counts for this key
    # A re-claimed key's attempt is counted just before its first run starts; until then
    # it is not (a graceful stop then has nothing to take back).
    counted: bool
    taken_over: bool  # a dead worker's key: a crash is in its history, its first run is alone
    task: asyncio.Task[Any] | None = None  # None while the claim waits for a runner
    lost: bool = False
    stopping: bool = False
    completing: bool = False
    started: bool = False  # holds a concurrency slot: the handler is about to run or runs

    @property
    def ident(self) -> KeyId:
        return self.fence.ident


class HeldClaim(Protocol):
    """A claim held while its run goes on, as the heartbeat reads and marks it."""

    lost: bool

    @property
    def fence(self) -> Fence: ...
    @property
    def lease_s(self) -> float: ...
    @property
    def completing(self) -> bool: ...
    @property
    def task(self) -> asyncio.Task[Any] | None: ...


H = TypeVar("H", bound=HeldClaim)


class HeldLeases(Generic[H]):
    """The claims a process holds, by (scope, key), their leases extended together: a worker's
    (Leases) and the HTTP middleware's (dedupe.asgi.run.HttpLeases)."""

    log: ClassVar[logging.Logger] = logger  # where a failed heartbeat is told

    def __init__(self, store: ClaimStore) -> None:
        self.store = store
        self._held: dict[KeyId, H] = {}

    def forget(self, held: H) -> None:
        ident = held.fence.ident
        if self._held.get(ident) is held:
            del self._held[ident]

    async def beat(self) -> None:
        """Extend every lease held; a run whose key another worker took is cancelled."""
        held = [h for h in self._held.values() if not h.completing]
        if not held:
            return
        try:
            ours = await self.store.heartbeat([(h.fence, h.lease_s) for h in held])
        except StoreError as exc:
            self.log.warning("heartbeat failed (leases may lapse): %s", exc)
            return
        for h in held:
            ident = h.fence.ident
            if ident not in ours and not h.completing and self._held.get(ident) is h:
                h.lost = True
                if h.task is not None:
                    h.task.cancel()


class Leases(HeldLeases[Lease]):
    """Every claim this worker holds, by (scope, key)."""

    def hold(self, ours: Ours, *, lease_s: float) -> Lease:
        """Record a claim of ours, from now until its outcome.

        A take-over means a worker died holding this key. Its first run here happens alone
        and is counted just before it starts, so that if this message is what kills workers,
        only it is charged for the crash, not the messages that were claimed beside it.
        A key handed back by a worker that stopped is counted the same way but need not
        run alone: no crash is in its history.
        """
        lease = Lease(
            fence=ours.fence,
            lease_s=lease_s,
            attempt=ours.attempts,
            counted=ours.counted,
            taken_over=ours.taken_over,
        )
        self._held[lease.ident] = lease
        return lease

    def take(self, ours: Ours, *, lease_s: float, task: asyncio.Task[Any]) -> Lease:
        """The held claim a runner starts on (held now if it was claimed after its batch)."""
        lease = self._held.get(ours.fence.ident)
        if lease is None or lease.fence != ours.fence or lease.task is not None:
            lease = self.hold(ours, lease_s=lease_s)
        lease.task = task
        return lease

    async def release(self, lease: Lease) -> None:
        """Give back at once a held claim that will not run."""
        if self._held.get(lease.ident) is lease:
            del self._held[lease.ident]
            await self.give_back(lease)

    async def give_back(self, lease: Lease) -> None:
        """Hand the key back at a graceful stop. The interrupted attempt is uncounted only if
        it was counted; a dead worker's key whose run never finished keeps its crash history
        (marked 'handed back after a take-over', not 'handed back'), so its next run still
        happens alone. Either mark keeps a heartbeat already sent from extending the lease."""
        fence = lease.fence
        try:
            await self.store.give_back(
                fence,
                attempt=lease.attempt if lease.counted else None,
                handed_back=not lease.taken_over,
            )
        except StoreError as exc:
            logger.warning("could not give back %s/%s: %s", fence.scope, fence.key, exc)

    def stop_waiting(self) -> None:
        """Cancel the runs that hold no slot yet (waiting for one, or for their turn alone)."""
        for lease in list(self._held.values()):
            if lease.task is not None and not (lease.started or lease.completing):
                lease.stopping = True
                lease.task.cancel()

    def stop_running(self) -> None:
        """Cancel every run not yet completing: their keys are given back."""
        for lease in list(self._held.values()):
            if lease.task is not None and not lease.completing:
                lease.stopping = True
                lease.task.cancel()


__all__ = ["HeldClaim", "HeldLeases", "Lease", "Leases"]
