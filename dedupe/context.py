"""What a handler sees besides its payload: the key, the attempt, and `ctx.db`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg

from dedupe.message import Message


class Effects(Protocol):
    """What a run can do beyond its return value (dedupe.effects.run_effects.RunEffects)."""

    async def publish(
        self,
        channel: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str: ...

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


# What a broken connection raises on its way out (a rollback or a release after the server
# or the network dropped it): such a connection is terminated, never handed back as it is.
BROKEN_CONNECTION: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
)


def connection_gone(conn: asyncpg.Connection) -> bool:
    """Whether the connection is gone (a pooled one lost mid-transaction is detached from its
    proxy, which then refuses every call)."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


class Database:
    """`ctx.db`: an asyncpg connection in the transaction that also records the outcome.

    The transaction starts on first use, so handlers that never touch the database cost no
    connection; writes made here commit atomically with the claim's completion, or not at all.
    """

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._conn: asyncpg.Connection | None = None
        self._tx: Any = None
        self._closed = False
        self._savepoints = 0  # how deep ctx.db.transaction() blocks are nested now
        # Called as a block begins, each returns what undoes the run's in-memory writes made
        # since (ctx.publish's outbox rows, stored at completion) if the block is rolled back.
        self._block_marks: list[Callable[[], Callable[[], None]]] = []

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    @property
    def started(self) -> bool:
        return self._conn is not None

    async def connection(self) -> asyncpg.Connection:
        """The underlying connection, with the transaction begun."""
        if self._closed:
            raise RuntimeError("ctx.db is closed: the handler's run is over")
        if self._conn is None:
            conn = await self._pool.acquire()
            try:
                tx = conn.transaction()
                await tx.start()
            except BaseException:
                await self._pool.release(conn)
                raise
            self._conn, self._tx = conn, tx
        return self._conn

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:
        conn = await self.connection()
        return str(await conn.execute(query, *args, timeout=timeout))

    async def executemany(self, query: str, args: Any, *, timeout: float | None = None) -> None:
        conn = await self.connection()
        await conn.executemany(query, args, timeout=timeout)

    async def fetch(self, query: str, *args: Any, timeout: float | None = None) -> list[Any]:
        conn = await self.connection()
        return list(await conn.fetch(query, *args, timeout=timeout))

    async def fetchrow(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        conn = await self.connection()
        return await conn.fetchrow(query, *args, timeout=timeout)

    async def fetchval(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        conn = await self.connection()
        return await conn.fetchval(query, *args, timeout=timeout)

    def on_block(self, mark: Callable[[], Callable[[], None]]) -> None:
        """`mark()` is called as each transaction() block begins; what it returns is called
        if the block is rolled back (the writes a run keeps in memory until its completion)."""
        self._block_marks.append(mark)

    def forget_blocks(self) -> None:
        """Drop what on_block registered, once the run is over: a run's marks refer to its
        effects, which refer to this transaction, a cycle only the cyclic GC would free."""
        self._block_marks.clear()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        """`async with ctx.db.transaction():` a savepoint in the run's transaction. If the
        block raises, what it wrote is rolled back and the exception goes on (the run's other
        writes stay, and a statement PostgreSQL refused inside it no longer aborts the run's
        transaction); if it ends, its writes stay, to commit with the outcome. Nests. The run's
        transaction itself is never committed or rolled back here."""
        conn = await self.connection()
        self._savepoints += 1
        name = f"dedupe_block_{self._savepoints}"
        try:
            await conn.execute(f"SAVEPOINT {name}")
            undo = [mark() for mark in self._block_marks]
            try:
                yield
            except BaseException:
                await _to_its_end(conn.execute(f"ROLLBACK TO SAVEPOINT {name}"), conn)
                for step in reversed(undo):
                    step()
                self._rolled_back_to_savepoint()
                raise
            await conn.execute(f"RELEASE SAVEPOINT {name}")
        finally:
            self._savepoints -= 1

    def _rolled_back_to_savepoint(self) -> None:
        """The run's transaction is whole again after a block that failed."""

    async def commit(self) -> None:
        if self._tx is not None:
            await self._tx.commit()
            self._tx = None

    async def close(self) -> None:
        """Roll back what was not committed and return the connection; safe to call twice.
        The run's block marks go too (forget_blocks): a block begun after this takes back no
        publishes (none can run a statement), one already open keeps what it marked."""
        self._closed = True
        self.forget_blocks()
        conn, tx, self._conn, self._tx = self._conn, self._tx, None, None
        if conn is None:
            return
        broken = BROKEN_CONNECTION
        try:
            if tx is not None:
                await tx.rollback()
        except broken:
            # The server rolls back a broken session by itself. Never hand a connection in an
            # unknown state back to the pool (asyncpg would reuse it): close it instead. A
            # connection lost mid-transaction may be detached from the pool already.
            with contextlib.suppress(*broken):
                conn.terminate()
        finally:
            with contextlib.suppress(*broken):
                await self._pool.release(conn)


# How long a block's ROLLBACK TO may still take once the run is cancelled (a lost lease, a
# stop, the handler's own timeout) before its connection is closed instead.
ROLLBACK_BOUND_S = 10.0


async def _to_its_end(
    statement: Awaitable[Any], conn: asyncpg.Connection, bound_s: float = ROLLBACK_BOUND_S
) -> Any:
    """Await a statement to its end even if the task is cancelled meanwhile, then let the
    cancellation go on: the connection is the run's, and its next statement (the handler's,
    the lane's RELEASE or ROLLBACK TO of the member, the completion) must not find it busy
    with this one (asyncpg: "another operation is in progress"). Once cancelled, it waits at
    most `bound_s` (a stalled connection must not hold the run): past it, the connection is
    terminated (the server rolls its whole transaction back; what was to complete on it fails
    as a broken connection does) and the cancellation goes on."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(statement)
    cancelled: asyncio.CancelledError | None = None
    deadline: float | None = None
    while not task.done():
        if deadline is not None and loop.time() >= deadline:
            conn.terminate()
            task.cancel()
            task.add_done_callback(_retrieved)  # it ends with the closed connection's error
            break
        try:
            await asyncio.wait([task], timeout=None if deadline is None else deadline - loop.time())
        except asyncio.CancelledError as exc:
            cancelled = exc
            if deadline is None:
                deadline = loop.time() + bound_s
    if cancelled is not None:
        if task.done():
            _retrieved(task)  # the cancellation is what goes on
        raise cancelled
    return task.result()


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(slots=True)
class Context:
    """Passed to handlers that take a second parameter."""

    key: str
    scope: str
    attempt: int
    message: Message
    db: Database
    logger: logging.LoggerAdapter[logging.Logger] = field(repr=False)
    effects: Effects | None = field(default=None, repr=False)

    async def publish(
        self,
        channel: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Publish through the outbox: stored in the completion transaction (a zombie's or a
        failed run's publishes roll back with its writes), relayed with confirms afterwards.

        Args:
            channel: Where to publish (a queue on RabbitMQ, a topic on Kafka).
            body: bytes, a pydantic model or a JSON value (encoded the same way every time).
            key: The message id; by default one derived from the scope, the key, the channel and
                this publish's place among the run's publishes to that channel (stable across
                attempts, so a re-run's copy is a duplicate downstream). Pass one when the
                handler publishes conditionally.
            headers: Message headers.

        Returns:
            The message id.
        """
        return await self._effects().publish(channel, body, key=key, headers=headers)

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` once per key: its JSON result is recorded under (scope, key,
        name) as soon as it returns and given back to later attempts without calling `fn`.

        `fn` may be sync (run in a thread) or async. Give the external system
        `f"{ctx.key}/{name}"` as its idempotency key: a crash between its call and the record
        repeats the call, with the same key.
        """
        return await self._effects().step(name, fn, *args, **kwargs)

    def _effects(self) -> Effects:
        if self.effects is None:
            raise RuntimeError("ctx.publish and ctx.step need the worker's run (not a test stub)")
        return self.effects
