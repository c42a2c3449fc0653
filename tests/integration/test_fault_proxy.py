"""The chaos tests' TCP fault proxy (tests/chaos/proxy.py), against real PostgreSQL and a local
echo server: latency each way, a stall that closes nothing, a cut that resets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from tests.chaos.proxy import FaultProxy


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def _round_trip(port: int, payload: bytes = b"ping") -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        began = time.monotonic()
        writer.write(payload)
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(len(payload)), 5)
        assert got == payload
        return time.monotonic() - began
    finally:
        writer.close()


async def test_forwards_in_order_and_adds_latency_each_way(echo: int) -> None:
    async with FaultProxy("127.0.0.1", echo) as proxy:
        plain = await _round_trip(proxy.port)
        big = bytes(range(256)) * 4096  # 1 MiB: many chunks, order kept
        assert await _round_trip(proxy.port, big) >= 0
        proxy.latency(0.05)
        slow = await _round_trip(proxy.port)
        assert slow >= 0.1, f"a round trip through 50 ms each way took {slow * 1000:.1f} ms"
        assert slow < 1.0
        proxy.heal()
        assert await _round_trip(proxy.port) < max(0.1, plain * 10)


async def test_a_stall_delivers_nothing_closes_nothing_then_resumes_in_order(echo: int) -> None:
    async with FaultProxy("127.0.0.1", echo) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"a")
        assert await asyncio.wait_for(reader.readexactly(1), 5) == b"a"
        proxy.stall()
        writer.write(b"bc")
        await writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(10), 0.3)
        assert proxy.open_connections == 1 and not writer.is_closing()
        proxy.resume()
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"bc"
        writer.close()


async def test_a_cut_resets_open_connections_and_refuses_until_healed(echo: int) -> None:
    async with FaultProxy("127.0.0.1", echo) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"x")
        assert await asyncio.wait_for(reader.readexactly(1), 5) == b"x"
        proxy.cut(refuse=True)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 5)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await _round_trip(proxy.port)
        proxy.heal()
        assert await _round_trip(proxy.port) < 5
        assert proxy.resets >= 2


async def test_postgresql_through_the_proxy_latency_stall_and_cut(db_url: str) -> None:
    """What a worker meets: a query pays the latency; a stalled connection answers nothing
    (only a client-side timeout ends the wait); a cut ends the connection with an error."""
    target = urlsplit(db_url)
    async with FaultProxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
        conn = await asyncpg.connect(proxy.url_for(db_url), ssl=False, timeout=10)
        try:
            assert await conn.fetchval("SELECT 1") == 1
            proxy.latency(0.005)
            began = time.monotonic()
            for _ in range(5):
                await conn.fetchval("SELECT 1")
            assert time.monotonic() - began >= 5 * 0.010
            proxy.heal()
            proxy.stall()
            with pytest.raises(TimeoutError):
                await conn.fetchval("SELECT 1", timeout=0.5)
            assert proxy.open_connections == 1
            proxy.cut()
        finally:
            conn.terminate()
        conn = await asyncpg.connect(proxy.url_for(db_url), ssl=False, timeout=10)
        try:
            proxy.cut()
            with pytest.raises((asyncpg.PostgresConnectionError, ConnectionError, OSError)):
                await conn.fetchval("SELECT 1", timeout=5)
        finally:
            conn.terminate()
