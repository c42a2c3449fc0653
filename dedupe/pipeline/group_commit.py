"""Group commit for handlers that write (`group_commit=True`): the runs of several messages share
one transaction, one completion statement and one COMMIT, each run inside a savepoint.

A lane is one connection with an open transaction; its members run one at a time. A member's
handler writes through `ctx.db` inside `SAVEPOINT dedupe_member`; a handler that fails rolls
back to it (only its own writes go). The lane commits as soon as no member waits for it (or
`max_group` have run): one fenced completion statement for all its members, then COMMIT. Should
the fence refuse any member (its key taken over meanwhile), the whole transaction rolls back,
the fenced members end as lease lost and the others are given back and requeued, to run again
at once: a fenced run writes nothing. A COMMIT that fails fails the group as the store's failure
(requeued: whether it committed is unknown, the claims tell).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg

from dedupe.claims.completion import Completion, OutboxRow, add_to_outbox, complete_in
from dedupe.claims.database import TRANSIENT_ERRORS
from dedupe.claims.records import Fence
from dedupe.claims.store import ClaimStore
from dedupe.context import Database
from dedupe.errors import StoreError
from dedupe.pipeline.stats import Stats

logger = logging.getLogger("dedupe.pipeline")

T = TypeVar("T")

_BROKEN = (*TRANSIENT_ERRORS, asyncpg.PostgresError)
SAVEPOINT = "SAVEPOINT dedupe_member"


class GroupRolledBack(StoreError):
    """A member of the group was fenced, so the group's transaction rolled back; this run's
    key was given back and its message runs again."""


class LaneDatabase(Database):
    """`ctx.db` of a group member: the lane's connection, inside the member's savepoint."""

    def __init__(self, conn: asyncpg.Connection, pool: asyncpg.Pool) -> None:
        super().__init__(pool)
        self._conn = conn
        # A statement PostgreSQL refused (or one cut off by a timeout) aborts the group's
        # transaction up to the savepoint: a handler that caught the error and went on cannot
        # complete in this group.
        self.tainted = False
        self._tainted_before: list[bool] = []  # at the start of each open transaction() block

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:
        return await self._watched(super().execute(query, *args, timeout=timeout))

    async def executemany(self, query: str, args: Any, *, timeout: float | None = None) -> None:
        await self._watched(super().executemany(query, args, timeout=timeout))

    async def fetch(self, query: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return await self._watched(super().fetch(query, *args, timeout=timeout))

    async def fetchrow(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        return await self._watched(super().fetchrow(query, *args, timeout=timeout))

    async def fetchval(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        return await self._watched(super().fetchval(query, *args, timeout=timeout))

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self._tainted_before.append(self.tainted)
        try:
            async with super().transaction():
                yield
        finally:
            self._tainted_before.pop()

    def _rolled_back_to_savepoint(self) -> None:
        # A ctx.db.transaction() block that failed was rolled back to its savepoint: what a
        # refused statement inside it aborted is whole again, the member is as suspect as it
        # was when the block began (if a statement through ctx.db.connection() aborted the
        # transaction after all, the member's RELEASE finds out).
        self.tainted = self._tainted_before[-1]

    async def _watched(self, statement: Awaitable[T]) -> T:
        """Await a ctx.db statement; one that does not return leaves the group's transaction
        suspect (tainted)."""
        try:
            return await statement
        except BaseException:  # refused, timed out or cancelled: the transaction is suspect
            self.tainted = True
            raise

    async def connection(self) -> asyncpg.Connection:
        if self._closed:
            raise RuntimeError("ctx.db is closed: the handler's run is over")
        assert self._conn is not None
        return self._conn

    async def commit(self) -> None:  # the lane commits the group
        return None

    async def close(self) -> None:  # the lane keeps its connection
        self._closed = True
        self.forget_blocks()  # (as Database.close: the run's marks close a cycle)


@dataclass(eq=False, slots=True)
class _Done:
    """A member that ran to its end: completed when the group commits."""

    fence: Fence
    result: str
    retention_s: float
    attempt: int  # the count its run made (taken back if the group rolls back)
    lease_s: float
    published: bool
    future: asyncio.Future[list[bool]]


class Lane:
    """One connection, one open transaction, members one at a time.

    Between members the transaction always holds a fresh `SAVEPOINT dedupe_member`: a member's
    end releases its own and makes the next (or rolls back to it), in one round trip, shielded
    from cancellation. The group commits when no member waits, when `max_group` have run, or
    once its oldest finished member has waited `hold_s` or a quarter of its lease (a finished
    member's claim is not heartbeated while it waits for the COMMIT).
    """

    def __init__(
        self, store: ClaimStore, *, max_group: int, hold_s: float, stats: Stats | None = None
    ) -> None:
        self.store = store
        self.stats = stats if stats is not None else Stats()
        self.max_group = max_group
        self.hold_s = hold_s
        self.waiting = 0
        self.on_published: Callable[[], None] | None = None
        self._lock = asyncio.Lock()
        self._conn: asyncpg.Connection | None = None
        self._group: list[_Done] = []
        self._deadline = 0.0  # loop time by which the open group commits
        self._flusher: asyncio.Task[None] | None = None

    @property
    def busy(self) -> int:
        return self.waiting + self._lock.locked()

    async def join(self) -> Member:
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        try:
            if self._conn is None:
                conn = await self.store.pool.acquire()
                try:
                    await asyncio.shield(conn.execute(f"BEGIN; {SAVEPOINT}"))
                except BaseException:
                    await self._discard(conn)
                    raise
                self._conn = conn
        except BaseException as exc:
            self._lock.release()
            if isinstance(exc, _BROKEN):
                raise StoreError(f"a group commit's connection failed: {exc}") from exc
            raise
        return Member(self, self._conn)

    async def finished(self, member: Member, done: _Done | None) -> None:
        """A member is done (`done`: it ran to its end; None: it failed or was cancelled):
        keep or roll back its writes, make the next savepoint, commit if it is time; let the
        next member in."""
        try:
            conn = self._conn
            if conn is None:
                return
            if done is not None and member.db.tainted:
                # A statement failed or was cut off under the handler, which went on: its
                # transaction is aborted, nothing of it can commit.
                done.future.set_exception(StoreError(TAINTED))
                done = None
            try:
                if done is not None:
                    try:
                        await conn.execute(f"RELEASE SAVEPOINT dedupe_member; {SAVEPOINT}")
                    except asyncpg.InFailedSQLTransactionError:
                        # Aborted after all (a statement through ctx.db.connection()): only
                        # this member's writes go; the savepoint is still there.
                        done.future.set_exception(StoreError(TAINTED))
                        done = None
                if done is None:
                    await conn.execute("ROLLBACK TO SAVEPOINT dedupe_member")
            except _BROKEN as exc:
                if done is not None and not done.future.done():
                    # Not in the group yet: _fail does not reach it; its message is requeued.
                    done.future.set_exception(
                        StoreError(f"a group commit's connection failed: {exc}")
                    )
                await self._fail(exc)
                return
            if done is not None:
                # Commit well inside the member's lease: its claim is not heartbeated now.
                due = asyncio.get_running_loop().time() + min(self.hold_s, done.lease_s / 4)
                self._deadline = min(self._deadline, due) if self._group else due
                self._group.append(done)
            now = asyncio.get_running_loop().time()
            if self._group and (
                self.waiting == 0 or len(self._group) >= self.max_group or now >= self._deadline
            ):
                await self._commit()
            elif not self._group and self.waiting == 0:
                await self._close_idle()
            elif self._group:
                self._flush_later()
        finally:
            self._lock.release()

    def _flush_later(self) -> None:
        """Commit the open group once no member is left to do it (a waiter cancelled before
        its turn leaves nobody behind it)."""
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="dedupe-group-flush")

    async def _flush(self) -> None:
        while True:
            await asyncio.sleep(min(self.hold_s, 0.05))
            async with self._lock:
                if not self._group:
                    if self._conn is not None and self.waiting == 0:
                        await self._close_idle()
                    return
                if self.waiting == 0 or asyncio.get_running_loop().time() >= self._deadline:
                    await self._commit()
                    return

    async def _close_idle(self) -> None:
        """No group and nobody waiting: end the empty transaction, give the connection back."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await conn.execute("ROLLBACK")
        except BaseException:
            await self._discard(conn)
            return
        with contextlib.suppress(Exception):
            await self.store.pool.release(conn)

    async def _commit(self) -> None:
        conn, self._conn = self._conn, None
        group, self._group = self._group, []
        assert conn is not None
        try:
            # The members' publishes are in the transaction already (Member.complete).
            completed = await complete_in(
                self.store, conn, [Completion(d.fence, d.result, d.retention_s) for d in group]
            )
            fenced = [d for d in group if d.fence.ident not in completed]
            await conn.execute("ROLLBACK" if fenced else "COMMIT")
        except BaseException as exc:
            error = StoreError(f"the group's COMMIT failed: {exc.__class__.__name__}: {exc}")
            for done in group:
                if not done.future.done():
                    done.future.set_exception(error)
            await self._discard(conn)
            if not isinstance(exc, Exception):
                raise
            return
        with contextlib.suppress(Exception):
            await self.store.pool.release(conn)
        if fenced:
            await self._rolled_back(group, fenced)
            return
        self.stats.groups_committed += 1
        self.stats.group_members_committed += len(group)
        for done in group:
            if not done.future.done():
                done.future.set_result([True])
        if any(d.published for d in group) and self.on_published is not None:
            self.on_published()

    async def _rolled_back(self, group: Sequence[_Done], fenced: Sequence[_Done]) -> None:
        """Some members were fenced: they end as lease lost; the others' keys are given back
        at once (their interrupted attempt taken back) and their messages requeued."""
        logger.warning(
            "group commit rolled back: %d of %d members were taken over by another worker; "
            "the other %d run again",
            len(fenced),
            len(group),
            len(group) - len(fenced),
        )
        for done in group:
            if done in fenced:
                done.future.set_result([False])
                continue
            with contextlib.suppress(StoreError):
                await self.store.give_back(done.fence, attempt=done.attempt, handed_back=True)
            done.future.set_exception(GroupRolledBack())

    async def _fail(self, exc: BaseException) -> None:
        """The lane's connection broke: its open group fails as the store's failure."""
        conn, self._conn = self._conn, None
        group, self._group = self._group, []
        error = StoreError(f"a group commit's connection failed: {exc.__class__.__name__}: {exc}")
        for done in group:
            if not done.future.done():
                done.future.set_exception(error)
        if conn is not None:
            await self._discard(conn)

    async def _discard(self, conn: asyncpg.Connection) -> None:
        with contextlib.suppress(Exception):
            conn.terminate()
        with contextlib.suppress(Exception):
            await self.store.pool.release(conn)


TAINTED = (
    "a ctx.db statement failed (or was cut off) and the handler went on: its transaction is "
    "aborted (put statements that may fail in `async with ctx.db.transaction():`, a savepoint)"
)


class Member:
    """One run in a lane's transaction."""

    def __init__(self, lane: Lane, conn: asyncpg.Connection) -> None:
        self.lane = lane
        self.db = LaneDatabase(conn, lane.store.pool)
        self._done: _Done | None = None
        self._left = False

    async def complete(
        self,
        fence: Fence,
        result: str,
        retention_s: float,
        outgoing: Sequence[OutboxRow],
        *,
        attempt: int,
        lease_s: float,
    ) -> asyncio.Future[list[bool]]:
        """Store the publishes in the savepoint; the completion goes with the group's. The
        future resolves once the group committed ([True]) or was refused by the fence
        ([False]: this run was taken over); GroupRolledBack when another member was."""
        if self.db.tainted:
            raise StoreError(TAINTED)
        if outgoing:
            try:
                await add_to_outbox(await self.db.connection(), outgoing, retention_s=retention_s)
            except _BROKEN as exc:
                raise StoreError(f"storing the run's publishes failed: {exc}") from exc
        future: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        self._done = _Done(fence, result, retention_s, attempt, lease_s, bool(outgoing), future)
        return future

    async def leave(self) -> None:
        """Keep the member's writes for the group if it completed, else roll them back."""
        if self._left:
            return
        self._left = True
        await asyncio.shield(self.lane.finished(self, self._done))


class Lanes:
    """A few lanes side by side; a member joins the least busy."""

    def __init__(
        self,
        store: ClaimStore,
        *,
        lanes: int = 4,
        max_group: int = 64,
        hold_s: float = 1.0,
        stats: Stats | None = None,
    ) -> None:
        self._lanes = [
            Lane(store, max_group=max_group, hold_s=hold_s, stats=stats)
            for _ in range(max(1, lanes))
        ]

    def set_on_published(self, callback: Callable[[], None] | None) -> None:
        for lane in self._lanes:
            lane.on_published = callback

    async def join(self) -> Member:
        return await min(self._lanes, key=lambda lane: lane.busy).join()


def group_commit_lanes(concurrency: int) -> int:
    """Lanes for a worker: a few, never more than its concurrency."""
    return max(1, min(4, concurrency))


__all__ = ["GroupRolledBack", "Lane", "LaneDatabase", "Lanes", "Member", "group_commit_lanes"]
