"""A real uvicorn server on 127.0.0.1 for the dedupe.asgi tests: in the test's event loop
(`serving`), or as processes a test can kill or freeze (`ApiProcesses`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.conftest import CHECKOUT_PATH, ROOT

UVICORN = [sys.executable, "-m", "uvicorn", "--factory", "tests.apps.http_api:from_environment"]


class QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the test process keeps its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def serving(asgi: Any) -> AsyncIterator[str]:
    """Serve `asgi` (lifespan on) until the block ends; yield its base URL."""
    config = uvicorn.Config(asgi, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = QuietServer(config)
    task = asyncio.create_task(server.serve(), name="test-uvicorn")
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        task.cancel()
        raise RuntimeError("uvicorn did not start within 5 s")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ApiProcesses:
    """`uvicorn --factory tests.apps.http_api:from_environment` processes on one port, one
    after the other (a test kills or freezes one and starts the next); `env` adds to the
    factory's settings (HTTP_API_ONE_TRANSACTION, ...)."""

    def __init__(
        self, db_url: str, logs: Path, *, lease_s: float, env: dict[str, str] | None = None
    ) -> None:
        self.db_url, self.logs, self.lease_s = db_url, logs, lease_s
        self.env = env or {}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "DEDUPE_DATABASE_URL": self.db_url,
            "HTTP_API_LEASE_S": str(self.lease_s),
            "PYTHONPATH": CHECKOUT_PATH,
            **self.env,
        }
        log = open(self.logs / f"api-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [*UVICORN, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, (self.logs / f"api-{len(self.procs) - 1}.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/orders/0", timeout=1).status_code == 404:
                    return proc
            time.sleep(0.1)
        raise AssertionError("the API did not start within 30 s")

    def close(self) -> None:
        """Stop every process still running (a frozen one is woken first)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
