"""docs/http-api.md's example, run as a user pastes it: the shell steps (migrate, the orders
table) and `orders_app.py` in an empty folder under `uvicorn orders_app:api`, then a request and
its retry against the real database."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import socket
import sys
from pathlib import Path

import asyncpg
import httpx

from tests.conftest import CHECKOUT_PATH, ROOT

DOCS = ROOT / "docs" / "http-api.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOCS.read_text(), flags=re.S)


def example() -> str:
    """The code block that is the file orders_app.py."""
    [found] = [b for b in blocks("python") if b.startswith('"""orders_app.py')]
    return found


def setup_steps() -> str:
    """The shell block that installs and prepares (the one that runs `dedupe-worker migrate`)."""
    [found] = [b for b in blocks("sh") if "dedupe-worker migrate" in b]
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_the_docs_example_runs_as_pasted(
    db_url: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    """Its steps say what to install, to migrate first and which table to make; its file
    imports what it uses and defines Order; served, a retried request makes one order."""
    steps = setup_steps()
    assert "pip install dedupe-worker fastapi uvicorn" in steps
    assert steps.index("dedupe-worker migrate") < steps.index("CREATE TABLE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUPE_", "PYTEST_"))}
    env.update(
        DEDUPE_DATABASE_URL=db_url,
        DEDUPE_HTTP_SECRET=secrets.token_urlsafe(32),
        PYTHONPATH=CHECKOUT_PATH,  # the package as installed: this checkout
    )
    migrate = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "dedupe.cli", "migrate"),
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(migrate.communicate(), 60)
    assert migrate.returncode == 0, output.decode()
    [table] = re.findall(r"-c '(CREATE TABLE[^']+)'", steps)
    await db.execute("DROP TABLE IF EXISTS orders")
    await db.execute(table)
    (tmp_path / "orders_app.py").write_text(example())
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "uvicorn", "orders_app:api", "--port", str(port)),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )

    async def log() -> str:
        """What uvicorn said (it is stopped first)."""
        if proc.returncode is None:
            proc.kill()
        assert proc.stdout is not None
        return (await asyncio.wait_for(proc.stdout.read(), 15)).decode()

    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            for _ in range(300):  # up to 30 s
                if proc.returncode is not None:
                    raise AssertionError(f"uvicorn stopped: {await log()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/docs", timeout=1)).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"uvicorn did not start: {await log()}")
            headers = {
                "Authorization": "Bearer tok_alice",
                "Idempotency-Key": "k1",
                "Content-Type": "application/json",
            }
            first = await client.post("/orders", content=b'{"sku":"pen"}', headers=headers)
            again = await client.post("/orders", content=b'{"sku":"pen"}', headers=headers)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 15)
    assert first.status_code == 201, first.text
    assert first.json() == {"order_id": 1}
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert await db.fetchval("SELECT count(*) FROM orders") == 1
