"""The HTTP side of the benchmarks shared by bench.receiver and bench.http_api: server processes
on 127.0.0.1 (`serving`), and a keep-alive HTTP/1.1 load generator on asyncio streams (`phase`),
cheap enough to share the cores with the servers it drives."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def event_loop() -> str:
    """The loop both kinds of server run on: `dedupe-worker receive --event-loop auto` and
    `uvicorn --loop auto` both take uvloop when it is installed."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def http_implementation() -> str:
    """uvicorn's HTTP protocol for every server of a bench: the receiver's, `dedupe-worker
    receive --http` (DEDUPE_RECEIVER_HTTP; h11 by default, which bounds a request's head).
    Runs before 2026-12-05 took uvicorn's default `http="auto"`, httptools when installed."""
    return os.environ.get("DEDUPE_RECEIVER_HTTP") or "h11"


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 response (Content-Length framed); return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.lower() == "content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


# The server processes by port, for their CPU time.
PROCESSES: dict[int, asyncio.subprocess.Process] = {}


def server_cpu_s(port: int) -> float:
    """User + system CPU seconds of the server on `port` so far (Linux /proc)."""
    proc = PROCESSES.get(port)
    if proc is None:
        return 0.0
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def database_cpu_s() -> float:
    """User + system CPU seconds so far of this machine's PostgreSQL processes (Linux /proc;
    every backend of the local cluster, whatever its database, and its background processes:
    the benches' database is on 127.0.0.1, and a quiet machine is theirs alone). A backend that
    exits takes its seconds with it: read around a phase whose pools stay open. NaN without
    /proc."""
    return services_cpu_s()[0]


def services_cpu_s() -> tuple[float, float]:
    """PostgreSQL's CPU seconds so far (database_cpu_s) and RabbitMQ's (its Erlang VM,
    beam.smp: the node the benches publish to), in one pass over /proc; NaN for one not
    running here (another host, another namespace: no figure rather than a zero)."""
    prefixes = ("postgres", "beam")
    ticks: list[int | None] = [None, None]
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: nothing to read
        return float("nan"), float("nan")
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, _, rest = stat.partition("(")[2].rpartition(")")
        for i, prefix in enumerate(prefixes):
            if name.startswith(prefix):
                fields = rest.split()
                ticks[i] = (ticks[i] or 0) + int(fields[11]) + int(fields[12])
    per_s = os.sysconf("SC_CLK_TCK")
    db, mq = (float("nan") if t is None else t / per_s for t in ticks)
    return db, mq


async def phase(
    port: int,
    requests: Sequence[bytes],
    *,
    connections: int,
    deadline: float,
    rate: float | None = None,
) -> dict[str, Any]:
    """Send each request once over `connections` keep-alive connections, as fast as they go or,
    with `rate`, open-loop: request i is due at start + i / rate and its latency counts from
    then (no coordinated omission). Stops at `deadline` (time.monotonic()) with what is left."""
    todo: asyncio.Queue[tuple[bytes, float]] = asyncio.Queue()
    begin = time.perf_counter()
    for i, request in enumerate(requests):
        todo.put_nowait((request, begin + i / rate if rate else 0.0))
    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not todo.empty() and time.monotonic() < deadline:
                request, due = todo.get_nowait()
                if due:
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                started = due or time.perf_counter()
                writer.write(request)
                await writer.drain()
                status = await read_response(reader)
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    cpu_before, (db_before, mq_before) = server_cpu_s(port), services_cpu_s()
    client_before = time.process_time()
    await asyncio.gather(*(client() for _ in range(connections)))
    elapsed = time.perf_counter() - begin
    client_s = time.process_time() - client_before  # before the reads of /proc below
    cpu_s, (db_after, mq_after) = server_cpu_s(port) - cpu_before, services_cpu_s()
    db_s, mq_s = db_after - db_before, mq_after - mq_before
    ms = sorted(x * 1000 for x in latencies)
    if len(ms) < 2:  # statistics.quantiles needs two; a phase cut short by its deadline
        ms = ms or [float("nan")]
        q = ms * 99
    else:
        q = statistics.quantiles(ms, n=100, method="inclusive")
    return {
        "requests": len(latencies),
        "planned": len(requests),
        "rate": len(latencies) / elapsed,
        "p50_ms": q[49],
        "p90_ms": q[89],
        "p99_ms": q[98],
        "max_ms": ms[-1],
        "statuses": dict(sorted(statuses.items())),
        # The server process's CPU (user + system) per request: steadier than the rate on a
        # shared machine (the database's and the broker's work are not in it).
        "cpu_ms": cpu_s * 1000 / max(1, len(latencies)),
        # PostgreSQL's CPU per request (all its processes: the work of the claims and the
        # endpoint's statements, and anything else the cluster did meanwhile).
        "db_cpu_ms": db_s * 1000 / max(1, len(latencies)),
        # RabbitMQ's, the same way (the publishes' work), and this load generator's own: with
        # the server's, what the machine's cores spent per request.
        "broker_cpu_ms": mq_s * 1000 / max(1, len(latencies)),
        "client_cpu_ms": client_s * 1000 / max(1, len(latencies)),
    }


async def wait_ready(
    port: int, proc: asyncio.subprocess.Process, *, path: str | None = None, timeout_s: float = 30
) -> None:
    """Until the server accepts a connection (or, with `path`, answers GET `path` with 200)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise SystemExit(f"a server exited with {proc.returncode}")
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                if path is None:
                    return
                writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                if await read_response(reader) == 200:
                    return
            finally:
                writer.close()
        await asyncio.sleep(0.2)
    raise SystemExit("a server did not become ready")


@contextlib.asynccontextmanager
async def serving(
    command: Sequence[str], env: dict[str, str], *, ready_path: str | None = None
) -> AsyncIterator[int]:
    """Run `command` + `--port <free port>` from the repository's root (bench/, handlers/ and
    consumers/ importable) until the block ends, then SIGTERM it (SIGKILL after 15 s)."""
    port = free_port()
    env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "consumers")]),
    }
    proc = PROCESSES[port] = await asyncio.create_subprocess_exec(
        *command, "--port", str(port), cwd=ROOT, env=env
    )
    try:
        await wait_ready(port, proc, path=ready_path)
        yield port
    finally:
        PROCESSES.pop(port, None)
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def uvicorn_command(factory: str) -> list[str]:
    """`uvicorn --factory <factory>` on 127.0.0.1, one process, with the options
    `dedupe-worker receive` gives uvicorn (dedupe_receiver.servers): the same event loop and
    HTTP implementation, lifespan on, no access log, no server header."""
    return [
        *[sys.executable, "-m", "uvicorn", "--factory", factory, "--host", "127.0.0.1"],
        *["--loop", event_loop(), "--http", http_implementation(), "--lifespan", "on"],
        *["--no-access-log", "--no-server-header", "--log-level", "warning"],
    ]
