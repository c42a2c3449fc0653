"""dedupe.testing's TestRun: an app run in this event loop on an in-memory broker, with the real
claim protocol on a throwaway PostgreSQL database; duplicates, lost acks, crash points and
take-overs on demand, and what happened, to inspect."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import asyncpg

from dedupe.app import STAGES as HOOK_STAGES
from dedupe.app import App, Hook
from dedupe.context import Context
from dedupe.message import Message
from dedupe.testing.databases import ClaimRow, Schema, create_database, drop_database, read_claims
from dedupe.testing.deliveries import Sent, Settled
from dedupe.testing.memory import MemoryBroker
from dedupe.testing.stages import STAGE_WORDS, STAGES, Point, Run, Stage, Stall
from dedupe.testing.steps import unwatch_steps, watch_steps
from dedupe.testing.workers import SimulatedWorker, WorkerDied, current_worker

_current_run: contextvars.ContextVar[TestRun | None] = contextvars.ContextVar(
    "dedupe_testing_run", default=None
)


def current_run() -> TestRun | None:
    """The TestRun whose worker runs the calling code (a fake client may want its database)."""
    return _current_run.get()


class TestRun:
    """An app run in-process on an in-memory broker, with the real claim protocol on a fresh
    PostgreSQL database cloned from a migrated template.

    `async with TestRun(app, database_url=...) as run:` runs the very App object a worker runs,
    hooks included, in simulated worker processes (each its own pool, claim store and
    Processor); a crash point kills the worker there and starts another, as a supervisor would.

    Args:
        app: The app under test.
        database_url: A PostgreSQL server to make the run's database on (the role needs
            CREATEDB); the database in the URL is used to connect, never written to.
        schema: The app's own tables: SQL, or an async callable given the database URL. Run
            once per process on the template, so every run starts with them, empty.
        max_delay_s: Longest wait before a deferred or requeued message comes back.
        concurrency: Each worker's concurrency (Processor).
        timeout_s: How long idle() waits by default.
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self,
        app: App,
        *,
        database_url: str,
        schema: Schema | None = None,
        max_delay_s: float | None = 0.1,
        concurrency: int = 8,
        timeout_s: float = 30.0,
    ) -> None:
        self.app = app
        self.server_url = database_url
        self.schema = schema
        self.timeout_s = timeout_s
        self.broker = MemoryBroker(max_delay_s=max_delay_s)
        self.workers: list[SimulatedWorker] = []
        self.runs: list[Run] = []
        self._concurrency = concurrency
        self._points: list[Point] = []
        self._chores: set[asyncio.Task[None]] = set()
        self._failures: list[BaseException] = []
        self._hook: tuple[frozenset[str], Hook] | None = None
        self._watching = False
        self._database_url: str | None = None
        self._pool: asyncpg.Pool | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> TestRun:
        self._database_url = await create_database(self.server_url, self.schema)
        try:
            self._pool = await asyncpg.create_pool(self._database_url, min_size=1, max_size=2)
            self.app.hook(*HOOK_STAGES)(self._at_stage)
            self._hook = self.app.hooks[-1]
            watch_steps(self.app, current_run)
            self._watching = True
            await self._start_worker()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._chores:  # first: a worker being replaced may start one more
            await asyncio.wait(set(self._chores), timeout=10)
        for worker in self.workers:
            with contextlib.suppress(Exception):
                await worker.close()
        self.broker.close()
        if self._hook is not None:
            with contextlib.suppress(ValueError):
                self.app.hooks.remove(self._hook)
        if self._watching:
            unwatch_steps(self.app)
            self._watching = False
        if self._pool is not None:
            await self._pool.close()
        if self._database_url is not None:
            await drop_database(self.server_url, self._database_url)

    @property
    def database_url(self) -> str:
        """The run's own database: the claims and the app's tables."""
        if self._database_url is None:
            raise RuntimeError("the run has not started: use `async with TestRun(...)`")
        return self._database_url

    @property
    def worker(self) -> SimulatedWorker:
        """The worker the broker delivers to now."""
        live = [w for w in self.workers if w.live]
        if not live:
            raise RuntimeError("no worker is running")
        return live[-1]

    # -- messages --------------------------------------------------------------------------

    def publish(
        self,
        channel: str,
        body: bytes | str | Any,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        copies: int = 1,
        delay_s: float = 0.0,
        lose_ack: bool = False,
    ) -> Sent:
        """Publish a message to the app's workers (bytes, text, a pydantic model or JSON).

        Args:
            message_id: The broker's message id (default: a new one).
            headers: Message headers (looked up case-insensitively, as on the real brokers).
            copies: How many times the producer sends it: a duplicate, at the same moment
                unless `delay_s` spaces them.
            delay_s: Each copy after the first comes this much later than the one before.
            lose_ack: The first ack never reaches the broker: the message comes again.
        """
        if channel not in self.app.channels:
            raise ValueError(
                f"no handler of app {self.app.name!r} consumes {channel!r} (its channels: "
                f"{', '.join(sorted(self.app.channels)) or 'none'})"
            )
        return self.broker.publish(
            channel,
            body,
            message_id=message_id,
            headers=headers,
            copies=copies,
            delay_s=delay_s,
            lose_ack=lose_ack,
        )

    def redeliver(self, sent: Sent, *, delay_s: float = 0.0) -> Sent:
        """The same message (id, body, headers) delivered once more, now or after `delay_s`."""
        message = sent.message
        return self.broker.publish(
            message.channel,
            message.body,
            message_id=message.message_id,
            headers=dict(message.headers),
            after_s=delay_s,
        )

    async def idle(self, timeout_s: float | None = None) -> None:
        """Wait until every message is acked or dead-lettered and no run is under way (a
        stalled run excepted); raise AssertionError saying what is left after `timeout_s`."""
        __tracebackhide__ = True
        limit = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        unsent = 0
        for _ in range(math.ceil(limit / 0.01) + 1):
            self._raise_failures()
            if self.quiet:
                # ctx.publish's rows are relayed after the commit: what they carry is still
                # to happen (the next stage of a chain, say).
                unsent = await self.unsent()
                if not unsent and self.quiet:
                    return
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.01)
        self._raise_failures()
        if not self.quiet or unsent:
            raise AssertionError(self._not_idle(limit, unsent))

    async def unsent(self) -> int:
        """How many outbox rows (ctx.publish) the relay has not sent yet."""
        query = "SELECT count(*) FROM dedupe_outbox WHERE sent_at IS NULL"
        return int(await self._db.fetchval(query))

    @property
    def quiet(self) -> bool:
        """Whether nothing is left to happen on the broker: every message acked or
        dead-lettered, no run under way (a stalled run excepted), no worker being replaced.
        idle() waits for the outbox's unsent rows too."""
        return (
            not self.broker.outstanding
            and not self._chores
            and not any(worker.busy for worker in self.workers)
        )

    async def blocked(self) -> int:
        """How many sessions on the run's database wait for a lock (a run behind a stalled
        zombie's uncommitted row, say)."""
        return int(
            await self._db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )

    # -- crash points and take-overs -------------------------------------------------------

    def crash_at(self, stage: Stage, *, key: str | None = None, expire_lease: bool = True) -> None:
        """The next run to reach `stage` (of `key`, or any) kills its worker there.

        Stages: "claimed" (the key is ours, the handler has not run), "stepped" (a ctx.step's
        function returned, its result is not recorded: the retry calls it again), "handled"
        (the handler returned, its ctx.db writes are not committed) and "completed"
        (committed, not acked). Another
        worker starts; the broker delivers the dead worker's messages to it and, with
        `expire_lease`, finds its leases lapsed (simulated: nothing waits for lease_s).
        """
        self._arm(Point(stage, key, None, expire_lease))

    def stall_at(self, stage: Stage, *, key: str | None = None) -> Stall:
        """The next run to reach `stage` is held there and its worker stops heartbeating (a
        long pause, a stopped process): see take_over() and Stall.resume()."""
        stall = Stall(stage, key)
        self._arm(Point(stage, key, stall))
        return stall

    async def take_over(self) -> SimulatedWorker:
        """Give up on the stalled workers, as the broker and the lease would: their messages
        go to a new worker, which finds their leases lapsed. Their runs go on once resumed,
        as zombies: whatever they complete is fenced, whatever they settle is dropped."""
        stalled = [w for w in self.workers if w.frozen and w.live]
        if not stalled:
            raise RuntimeError("no worker is stalled: hold one first with run.stall_at(...)")
        for worker in stalled:
            worker.lose_to_another()
            await self._expire(worker.owner)
        if not any(w.live for w in self.workers):
            return await self._start_worker()
        return self.worker

    async def expire_leases(self) -> int:
        """Let every lease in progress lapse now, as if lease_s had passed; how many did."""
        return await self._expire(None)

    @property
    def armed(self) -> list[tuple[Stage, str | None]]:
        """The crash points and stalls no run has reached yet: (stage, key or None)."""
        return [(point.stage, point.key) for point in self._points]

    def _arm(self, point: Point) -> None:
        if point.stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, not {point.stage!r}")
        self._points.append(point)

    async def _at_stage(self, stage: str, message: Message, scope: str, key: str) -> None:
        """The hook the run adds to the app: counts runs, fires the crash points and stalls."""
        await self._reached(stage, scope, key)

    async def stepped(self, ctx: Context, name: str) -> None:
        """A ctx.step's function returned (dedupe.testing.steps): the "stepped" stage."""
        await self._reached("stepped", ctx.scope, ctx.key, f" (step {name!r})")

    async def _reached(self, stage: str, scope: str, key: str, what: str = "") -> None:
        worker = current_worker()
        if worker is None or worker not in self.workers:
            return  # another run's worker, or a real one: not ours to touch
        if stage == "claimed":
            self.runs.append(Run(scope, key, worker.name))
        point = next((p for p in self._points if p.stage == stage and p.key in (None, key)), None)
        if point is None:
            return
        self._points.remove(point)
        if point.stall is None:
            if stage == "claimed":  # it dies before its handler is called
                self.runs[-1] = dataclasses.replace(self.runs[-1], ran=False)
            worker.die()
            self._chore(self._replace(worker, expire=point.expire_lease))
            raise WorkerDied(
                f"worker {worker.name} died {STAGE_WORDS[stage]}{what} of {scope}/{key}"
            )
        await point.stall.hold(worker)

    async def _replace(self, dead: SimulatedWorker, *, expire: bool) -> None:
        if expire:
            await self._expire(dead.owner)
        if not any(w.live for w in self.workers):
            await self._start_worker()
        await dead.close()

    async def _expire(self, owner: str | None) -> int:
        status = await self._db.execute(
            "UPDATE dedupe_claims SET lease_until = now() - interval '1 second'"
            " WHERE status = 'in_progress' AND ($1::text IS NULL OR owner = $1)",
            owner,
        )
        return int(status.split()[-1])

    async def _start_worker(self) -> SimulatedWorker:
        number = len(self.workers)
        name = chr(ord("a") + number) if number < 26 else f"w{number}"
        context = contextvars.copy_context()
        context.run(_current_run.set, self)
        worker = SimulatedWorker(
            self.app,
            self.broker,
            self.database_url,
            name=name,
            concurrency=self._concurrency,
            context=context,
        )
        self.workers.append(worker)
        await worker.start()
        return worker

    def _chore(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro, name="dedupe-testing-chore")
        self._chores.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._chores.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self._failures.append(task.exception())  # type: ignore[arg-type]

        task.add_done_callback(done)

    def _raise_failures(self) -> None:
        if self._failures:
            raise RuntimeError("the test run failed to replace a worker") from self._failures[0]

    def _not_idle(self, limit: float, unsent: int = 0) -> str:
        lines = [f"the test run is not idle after {limit:g}s:"]
        if unsent:
            lines.append(f"  {unsent} outbox rows (ctx.publish) not relayed yet")
        for message in self.broker.outstanding:
            last = [s for s in self.broker.log if s.message.message_id == message.message_id]
            told = f", last told: {last[-1].settlement.detail or last[-1].fate}" if last else ""
            lines.append(
                f"  {message.channel} {message.message_id!r}: delivery {message.attempt}{told}"
            )
        for worker in self.workers:
            if worker.frozen and worker.state != "dead":
                lines.append(
                    f"  worker {worker.name} is stalled (stall_at): resume it or take_over()"
                )
            elif worker.busy:
                lines.append(f"  worker {worker.name} has {worker.transport.in_flight} runs")
        return "\n".join(lines)

    # -- what happened ---------------------------------------------------------------------

    @property
    def log(self) -> list[Settled]:
        """Every settlement any worker told the broker, in order, with what it made of it."""
        return self.broker.log

    @property
    def acked(self) -> list[Settled]:
        return self.broker.acked

    @property
    def dead_letters(self) -> list[Settled]:
        """The dead letters (`.reason`, `.detail`, `.headers` as the real brokers carry)."""
        return self.broker.dead_letters

    @property
    def published(self) -> list[Message]:
        """What the app published with ctx.publish, as the outbox relay sent it, in order. A
        message to a channel the app consumes is delivered to its handler too (a chain's next
        stage runs); one to any other channel is only kept here."""
        return list(self.broker.published)

    def published_to(self, channel: str) -> list[Message]:
        """The messages relayed to `channel` (a relay that died before marking a row sent
        sends it again: the same message id twice, which the next stage takes as a duplicate)."""
        return self.broker.published_to(channel)

    @property
    def _db(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the run has not started: use `async with TestRun(...)`")
        return self._pool

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """Query the run's database (the app's tables, the claims)."""
        return list(await self._db.fetch(query, *args))

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self._db.fetchval(query, *args)

    async def execute(self, query: str, *args: Any) -> str:
        return str(await self._db.execute(query, *args))

    async def claims(self) -> list[ClaimRow]:
        """The claims table, oldest first."""
        return await read_claims(self._db)

    async def result(self, key: str, *, scope: str | None = None) -> Any:
        """The stored result of the completed claim of `key` (in `scope`, when several
        handlers hold that key), decoded; LookupError when there is none."""
        found = [c for c in await self.claims() if c.key == key and scope in (None, c.scope)]
        if not found:
            raise LookupError(f"no claim of key {key!r}" + (f" in {scope!r}" if scope else ""))
        if len(found) > 1:
            scopes = ", ".join(c.scope for c in found)
            raise LookupError(f"key {key!r} is claimed in several scopes ({scopes}): pass scope=")
        [claim] = found
        if claim.status != "completed":
            why = ": ".join(part for part in (claim.reason, claim.error) if part)
            raise LookupError(f"key {key!r} is {claim.status}, not completed: {why or '-'}")
        return claim.result


__all__ = ["TestRun", "current_run"]
