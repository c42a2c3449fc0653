"""CPU per request of IdempotencyMiddleware: the orders API driven in-process, no HTTP server.

    .venv/bin/python -m bench.http_core [--n 2000] [--concurrency 16] [--rounds 3]
                                        [--modes bare,hand,floor,two,one] [--profile out.txt]
                                        [--interleave]

handlers/orders_api.py's `POST /orders` (the API of bench/http_api.py) is called as an ASGI app
by `--concurrency` tasks, on a real PostgreSQL (a fresh database), without uvicorn or sockets:
the endpoint alone (`bare`: its writes in a transaction of their own), the same endpoint made
idempotent by hand in the fewest statements one transaction can take (`hand`,
bench.http_api.by_hand: a floor, not a safe baseline), the claims protocol's one-transaction
path written straight (`floor`, bench.protocol_floor: what a leaner middleware could cost; new
keys only, its replays are 409s), then behind the middleware on two commits (`two`) and in one
transaction (`one`), each keyed mode with `--n` new keys and then the same
`--n` requests again (replays). Reported: this process's CPU time per request
(`time.process_time`; the asyncpg client's work is in it, PostgreSQL's is not; PostgreSQL's
processes' CPU per request is reported beside it, `pg_us`), which a busy
machine disturbs far less than a rate. The middleware's own cost is a mode's figure minus the
endpoint's. `--interleave` starts every mode's app once and alternates their phases of new keys
round by round in one process (new keys only; the least spread between modes). `--profile`
writes cProfile's top functions of the keyed phases. Not in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BODY = json.dumps({"sku": "bench", "quantity": 1}).encode()
TOKEN = b"Bearer bench-token"
SECRET = "bench-only-principal-secret"
MODES = ("bare", "hand", "floor", "two", "one")
T = TypeVar("T")


def make_api(mode: str, url: str) -> Any:
    os.environ["DEDUPE_DATABASE_URL"] = url
    os.environ.setdefault("DEDUPE_HTTP_SECRET", SECRET)
    from bench import http_api

    if mode == "bare":
        return http_api.without()
    if mode == "hand":
        return http_api.by_hand()
    if mode == "floor":
        return http_api.protocol_floor()
    if mode == "two":
        return http_api.with_middleware()
    return http_api.with_one_transaction()


class Lifespan:
    """The ASGI lifespan of an app, as a server runs it: startup on enter, shutdown on exit."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.state: dict[str, Any] = {}

    async def __aenter__(self) -> Lifespan:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        self.task = asyncio.create_task(self.app(scope, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        message = await self.outbox.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"startup: {message}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.outbox.get()
        assert self.task is not None
        await self.task


async def call(app: Any, state: dict[str, Any], key: bytes | None) -> int:
    """One POST /orders as uvicorn would pass it; its status."""
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"authorization", TOKEN),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
    ]
    if key is not None:
        headers.append((b"idempotency-key", key))
    return await post(app, state, "/orders", headers, BODY)


async def post(
    app: Any, state: dict[str, Any], path: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> int:
    """One POST of `body` to `path` as uvicorn would pass it to the ASGI app; its status."""
    scope = post_scope(state, path, headers)
    done = asyncio.get_running_loop().create_future()
    received = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            _settle(done)

    await app(scope, receive, send)
    _settle(done)
    return status


def post_scope(
    state: dict[str, Any], path: str, headers: list[tuple[bytes, bytes]]
) -> dict[str, Any]:
    """The ASGI scope uvicorn passes for a POST to `path` (with its `?query`, if any) with
    `headers` (the lifespan's state)."""
    path, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": headers,
        "state": dict(state),
    }


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def phase(
    app: Any, state: dict[str, Any], keys: list[bytes | None], concurrency: int
) -> dict[str, Any]:
    """The requests, `concurrency` at a time: CPU µs per request, rate, statuses."""
    return await timed(keys, concurrency, lambda key: call(app, state, key))


async def timed(
    items: Sequence[T], concurrency: int, one: Callable[[T], Awaitable[int]]
) -> dict[str, Any]:
    """`one(item)` for every item, `concurrency` at a time: this process's CPU µs per item,
    the rate and the statuses answered."""
    todo: Iterator[T] = iter(items)
    statuses: dict[int, int] = {}

    async def worker() -> None:
        for item in todo:
            status = await one(item)
            statuses[status] = statuses.get(status, 0) + 1

    from bench.load import database_cpu_s

    db_before = database_cpu_s()
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
    db_s = database_cpu_s() - db_before
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    n = len(items)
    return {
        "cpu_us": round((user + system) / n * 1e6, 1),
        "sys_us": round(system / n * 1e6, 1),
        # PostgreSQL's CPU per request (its processes on this machine, bench.load).
        "pg_us": round(db_s / n * 1e6, 1),
        # Sleeps of the process per request (in epoll_wait, waiting for PostgreSQL).
        "wakeups": round((after.ru_nvcsw - before.ru_nvcsw) / n, 2),
        "rate": round(n / wall),
        "statuses": statuses,
    }


async def run_mode(mode: str, url: str, args: argparse.Namespace, profiler: Any) -> dict[str, Any]:
    app = make_api(mode, url)
    async with Lifespan(app) as life:
        run = uuid.uuid4().hex[:8]
        warm: list[bytes | None] = [
            None if mode == "bare" else f"warm-{run}-{i}".encode() for i in range(200)
        ]
        await phase(app, life.state, warm, args.concurrency)
        await phase(app, life.state, warm, args.concurrency)
        if mode == "bare":
            with profiler(mode) if profiler is not None else contextlib.nullcontext():
                return {"new": await phase(app, life.state, [None] * args.n, args.concurrency)}
        keys: list[bytes | None] = [f"{run}-{i}".encode() for i in range(args.n)]
        with profiler(mode) if profiler is not None else contextlib.nullcontext():
            new = await phase(app, life.state, keys, args.concurrency)
            replay = await phase(app, life.state, keys, args.concurrency)
        return {"new": new, "replay": replay}


async def interleaved(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every mode's app started once in this process, their phases of new keys alternating
    (the order reversed every other round) after a round of warm-up: the process's drift and
    the machine's hit every mode alike."""
    apps = {mode: make_api(mode, url) for mode in args.modes}
    run = uuid.uuid4().hex[:8]
    rounds: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        lives = {mode: await stack.enter_async_context(Lifespan(a)) for mode, a in apps.items()}
        for number in range(args.rounds + 1):
            figures = {}
            for mode in args.modes if number % 2 == 0 else list(reversed(args.modes)):
                keys: list[bytes | None] = [
                    None if mode == "bare" else f"{run}-{mode}-{number}-{i}".encode()
                    for i in range(args.n)
                ]
                figures[mode] = {
                    "new": await phase(apps[mode], lives[mode].state, keys, args.concurrency)
                }
            for mode, figure in figures.items():  # every request a new key's answer
                if set(figure["new"]["statuses"]) != {201}:
                    raise RuntimeError(f"{mode}: answered {figure['new']['statuses']}")
            if number > 0:
                rounds.append(figures)
                print(json.dumps({"round": number, **figures}), file=sys.stderr)
    return rounds


async def measure(args: argparse.Namespace, profiler: Any) -> dict[str, Any]:
    from bench.harness import fresh_database
    from handlers.orders_api import setup

    rounds: list[dict[str, Any]] = []
    async with fresh_database() as url:
        await setup(url)
        if args.interleave:
            rounds = await interleaved(url, args)
        for number in range(0 if args.interleave else args.rounds):
            figures = {}
            for mode in args.modes:
                figures[mode] = await run_mode(mode, url, args, profiler)
            rounds.append(figures)
            print(json.dumps({"round": number + 1, **figures}), file=sys.stderr)
    medians: dict[str, float] = {}
    for mode in args.modes:
        for kind in ("new", "replay"):
            for figure in ("cpu_us", "pg_us"):
                values = [r[mode][kind][figure] for r in rounds if kind in r[mode]]
                if values:
                    medians[f"{mode}_{kind}_{figure}"] = statistics.median(values)
    import dedupe

    return {"code": str(Path(dedupe.__file__).parent), "n": args.n, "medians": medians}


@contextlib.contextmanager
def cpu_cprofile() -> Iterator[cProfile.Profile]:
    """A cProfile of the block on the process's CPU clock: the waits on PostgreSQL and the
    broker are not the process's cost."""
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    try:
        yield profile
    finally:
        profile.disable()


def write_cprofile(profile: cProfile.Profile, out: io.StringIO, dump: str) -> None:
    """A cProfile's top functions by own time and by cumulative time into `out`; the raw
    profile into `dump` (for pstats' callers)."""
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats(120)
    profile.dump_stats(dump)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="bare,two,one", help="of bare, hand, two, one")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="new keys only, every mode's phases alternating in one process (least spread)",
    )
    parser.add_argument("--asyncio", dest="uvloop", action="store_false", help="no uvloop")
    parser.add_argument("--profile", help="write a profile of the keyed phases here")
    parser.add_argument("--profiler", choices=["pyinstrument", "cprofile"], default="pyinstrument")
    parser.add_argument("--profile-all", action="store_true", help="pyinstrument: every frame")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    if not set(args.modes) <= set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    if args.interleave and args.profile:
        parser.error("--interleave does not profile")
    if args.uvloop:
        import uvloop

        uvloop.install()
    profiles: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def profiled(mode: str) -> Iterator[None]:
        # CPU time, not wall time: the waits on PostgreSQL are not the process's cost.
        if args.profiler == "cprofile":
            with cpu_cprofile() as profile:
                yield
        else:
            from pyinstrument import Profiler
            from pyinstrument.stack_sampler import get_stack_sampler

            get_stack_sampler().timer_func = time.process_time
            profile = Profiler(interval=0.0001, async_mode="disabled")
            profile.start()
            try:
                yield
            finally:
                profile.stop()
        profiles.append((mode, profile))

    report = asyncio.run(measure(args, profiled if args.profile else None))
    if args.profile:
        out = io.StringIO()
        for mode, profile in profiles:
            out.write(f"== {mode}: {'requests' if mode == 'bare' else 'new keys then replays'}\n")
            if isinstance(profile, cProfile.Profile):
                write_cprofile(profile, out, f"{args.profile}.{mode}.prof")
            else:
                out.write(profile.output_text(unicode=False, show_all=args.profile_all))
        Path(args.profile).write_text(out.getvalue())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
