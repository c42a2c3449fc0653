"""`make demo`'s HTTP section: the orders API (handlers/orders_api.py) behind
IdempotencyMiddleware as a uvicorn process; 20 concurrent submits of one order, a retry after
a SIGKILL of the API mid-request, and the SQL that shows one order per key.

The API process serves `demo_http:api` (this module, from --app-dir scripts): the example with
a short lease (3 s) and a wait for duplicates, plus a demo-only pause of the answer when a
request carries `X-Demo-Pause-S` (headers are not part of the fingerprint, so the retry
without it is the same request).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import asyncpg
import httpx

ROOT = Path(__file__).resolve().parent.parent
LEASE_S = 3.0
AUTH = {"Authorization": "Bearer demo-customer-42"}
ORDER = {"sku": "espresso-machine", "quantity": 1}
UVICORN = [sys.executable, "-m", "uvicorn", "--factory", "--app-dir", "scripts", "demo_http:api"]


def say(text: str) -> None:
    print(f"demo http: {text}", flush=True)


class _PauseAnswer:
    """Demo only: holds the endpoint's answer (its order inserted, not committed) for the
    seconds in X-Demo-Pause-S, so the API can be killed mid-request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        pause = dict(scope.get("headers", [])).get(b"x-demo-pause-s")

        async def paused(message: Any) -> None:
            if pause and message["type"] == "http.response.start":
                await asyncio.sleep(float(pause))
            await send(message)

        await self.app(scope, receive, paused)


def api() -> Any:
    """The API process's app (`uvicorn --factory --app-dir scripts demo_http:api`)."""
    from starlette.middleware import Middleware

    sys.path.insert(0, str(ROOT))
    from handlers.orders_api import create_api

    app = create_api(lease_s=LEASE_S, wait_s=5.0)
    app.user_middleware.append(Middleware(_PauseAnswer))  # inside the idempotency middleware
    return app


class ApiProcess:
    def __init__(self, db_url: str, logs: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.base = f"http://127.0.0.1:{self.port}"
        self.db_url, self.logs = db_url, logs
        # The callers' HMAC key: one for every process of the API, restarts included.
        self.secret = os.environ.get("DEDUPE_HTTP_SECRET") or secrets.token_urlsafe(32)
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "DEDUPE_DATABASE_URL": self.db_url,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "consumers")]),
            "DEDUPE_HTTP_SECRET": self.secret,
        }
        log = open(self.logs / "api.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*UVICORN, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    async def start(self) -> None:
        self.spawn()
        async with httpx.AsyncClient() as client:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.base}/orders/0")).status_code == 404:
                        return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the API did not start; see {self.logs / 'api.log'}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


async def run_http_demo(db_url: str, logs: Path) -> bool:
    """Run the section; True when every key made exactly one order."""
    server = ApiProcess(db_url, logs)
    await server.start()
    say(f"orders API on {server.base} (FastAPI + IdempotencyMiddleware, lease {LEASE_S:g} s)")
    try:
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as client:
            headers = {**AUTH, "Idempotency-Key": "order-double-tap"}
            answers = await asyncio.gather(
                *(client.post("/orders", json=ORDER, headers=headers) for _ in range(20))
            )
            statuses = sorted({a.status_code for a in answers})
            bodies = {a.content for a in answers}
            replayed = sum(a.headers.get("idempotent-replayed") == "true" for a in answers)
            say(
                f"20 concurrent submits of one order: statuses {statuses}, {len(bodies)} distinct"
                f" body, {replayed} marked Idempotent-Replayed"
            )
            headers = {**AUTH, "Idempotency-Key": "order-after-crash"}
            pending = asyncio.ensure_future(
                client.post("/orders", json=ORDER, headers={**headers, "X-Demo-Pause-S": "30"})
            )
            await asyncio.sleep(1.0)
            server.kill()
            with contextlib.suppress(httpx.HTTPError):
                await pending
            say("SIGKILLed the API mid-request (its order inserted, not committed); restarting")
            await server.start()
            began = time.monotonic()
            retry = await client.post("/orders", json=ORDER, headers=headers)
            tries = 1
            while retry.status_code == 409 and time.monotonic() - began < LEASE_S + 10:
                await asyncio.sleep(float(retry.headers.get("retry-after", "1")))
                retry = await client.post("/orders", json=ORDER, headers=headers)
                tries += 1
            again = await client.post("/orders", json=ORDER, headers=headers)
            replay = again.headers.get("idempotent-replayed")
            say(
                f"the client's retry: {retry.status_code} {retry.text} after"
                f" {time.monotonic() - began:.1f} s and {tries - 1} x 409 (the server held it up"
                f" to wait_s=5 for the dead process's {LEASE_S:g} s lease to lapse);"
                f" once more: {again.status_code}, Idempotent-Replayed: {replay}"
            )
    finally:
        server.stop()
    conn = await asyncpg.connect(db_url)
    try:
        sql = "SELECT idempotency_key, count(*) AS orders FROM orders GROUP BY 1 ORDER BY 1"
        rows = await conn.fetch(sql)
    finally:
        await conn.close()
    print()
    print(f'  psql {db_url} -c "{sql}"')
    for row in rows:
        print(f"    {row['idempotency_key']:<20} {row['orders']}")
    ok = (
        statuses == [201]
        and len(bodies) == 1
        and retry.status_code == 201
        and [(r["idempotency_key"], r["orders"]) for r in rows]
        == [("order-after-crash", 1), ("order-double-tap", 1)]
    )
    print()
    print("HTTP RESULT: " + ("one order per key" if ok else "MISMATCH, see above"))
    return ok
