"""A refused body still gets its answer: a client sends the whole body before it reads, so the
receiver reads and drops the rest of a body over the limit (within bounds) before its 413;
a server that closed with bytes unread would reset the connection and destroy the 413."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dedupe_receiver import limits as receiver_limits
from tests.conftest import eventually
from tests.integration.test_receiver import (  # noqa: F401 - fixtures
    CountingPublisher,
    assert_problem,
    client,
    github_request,
    hooks,
    publisher,
    receive_process,
    secrets,
)

MIB = 1024 * 1024
LIMIT = MIB  # the default max_body_bytes of the test apps
TRIES = 20
CHUNK = 64 * 1024


# -- a real uvicorn server (`dedupe-worker receive`) and a real client -----------------------


async def serving(proc: subprocess.Popen[bytes], port: int, log: Path) -> str:
    """The receiver's base URL, once /readyz says it is ready."""
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:

        async def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the receiver exited: {await asyncio.to_thread(log.read_text)}")
            with contextlib.suppress(httpx.TransportError):
                return (await http.get("/readyz")).status_code == 200
            return False

        await eventually(up, interval_s=0.2)
    return base


async def post_oversized(http: httpx.AsyncClient, size: int, framing: str) -> tuple[str, object]:
    """What the client got ("413", another status, or the transport error's class), and the
    client's address of the connection it came on."""
    body = b"x" * size
    headers = github_request(body, "d-big")

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, size, CHUNK):
            yield body[start : start + CHUNK]

    content = body if framing == "content-length" else chunks()
    try:
        response = await http.post("/webhooks/github", content=content, headers=headers)
    except httpx.TransportError as exc:
        return type(exc).__name__, None
    if response.status_code != 413:
        return str(response.status_code), None
    assert_problem(response, 413, "payload-too-large")
    assert "close" not in response.headers.get("connection", "")  # read to its end: kept
    return "413", response.extensions["network_stream"].get_extra_info("client_addr")


def assert_all_413(outcomes: list[str]) -> None:
    counts = collections.Counter(outcomes)
    assert counts == {"413": TRIES}, f"{dict(counts)} in order {outcomes}"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("size", [2 * MIB, 8 * MIB], ids=["2MiB", "8MiB"])
async def test_twenty_oversized_bodies_on_fresh_connections_all_read_their_413(
    receive_process: tuple[subprocess.Popen[bytes], int, Path],  # noqa: F811
    size: int,
    framing: str,
) -> None:
    """Each on a new connection, with a Content-Length or chunked: a 413, never a reset."""
    base = await serving(*receive_process)
    outcomes = []
    for _ in range(TRIES):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            outcomes.append((await post_oversized(http, size, framing))[0])
    assert_all_413(outcomes)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("size", [2 * MIB, 8 * MIB], ids=["2MiB", "8MiB"])
async def test_twenty_oversized_bodies_on_one_keep_alive_connection_all_read_their_413(
    receive_process: tuple[subprocess.Popen[bytes], int, Path],  # noqa: F811
    size: int,
    framing: str,
) -> None:
    """A refused body read to its end leaves the connection clean: the receiver keeps it,
    and every next request on it is answered too."""
    base = await serving(*receive_process)
    outcomes, connections = [], set()
    limits = httpx.Limits(max_connections=1)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as http:
        for _ in range(TRIES):
            outcome, connection = await post_oversized(http, size, framing)
            outcomes.append(outcome)
            connections.add(connection)
    assert_all_413(outcomes)
    assert len(connections) == 1, connections


async def test_a_client_waiting_for_100_continue_gets_the_413_and_sends_no_body(
    receive_process: tuple[subprocess.Popen[bytes], int, Path],  # noqa: F811
) -> None:
    """Declared too large with Expect: 100-continue: the 413 comes at once, no "100 Continue"
    before it (which would ask for the body), and the connection is closed cleanly."""
    base = await serving(*receive_process)
    port = int(base.rsplit(":", 1)[1])
    headers = github_request(b"", "d-expect")
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = (
        f"POST /webhooks/github HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
        f"Content-Length: {2 * MIB}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # until the server closes
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"connection: close" in answer.lower()
    assert b"payload-too-large" in answer


async def test_an_endless_request_head_is_cut_off_and_the_receiver_serves_on(
    receive_process: tuple[subprocess.Popen[bytes], int, Path],  # noqa: F811
) -> None:
    """A header line that never ends: the receiver (uvicorn's h11, `--http`'s default) stops
    reading it after its 16 KiB bound and closes, long before the 64 MiB the client would
    send (httptools read all of it into memory and handed it on); the next request is served."""
    base = await serving(*receive_process)
    port = int(base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk, sent, total = b"a" * CHUNK, 0, 64 * MIB
    answer = b""
    try:
        writer.write(b"POST /webhooks/github HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
        async with asyncio.timeout(30):
            while sent < total:
                writer.write(chunk)
                await writer.drain()
                sent += CHUNK
        pytest.fail(f"the receiver read a {sent // MIB} MiB header line")
    except TimeoutError:
        pytest.fail(f"the receiver stopped reading after {sent // MIB} MiB but kept the connection")
    except ConnectionError:
        with contextlib.suppress(ConnectionError, TimeoutError):
            answer = await asyncio.wait_for(reader.read(200), 5)
    finally:
        writer.close()
    # What the socket buffers took before the close reached us, not what the server kept.
    assert sent < 16 * MIB, sent
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400 "), answer
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        assert (await http.get("/readyz")).status_code == 200


# -- the bounds, in-process ------------------------------------------------------------------


class Sender:
    """A request body of `size` bytes in chunks, counting what the receiver took, optionally
    slowing down once the limit is passed."""

    def __init__(self, size: int, *, pause_s: float = 0.0) -> None:
        self.size, self.pause_s, self.sent = size, pause_s, 0

    async def chunks(self) -> AsyncIterator[bytes]:
        while self.sent < self.size:
            if self.sent > LIMIT:
                await asyncio.sleep(self.pause_s)
            self.sent += CHUNK
            yield b"x" * CHUNK


async def test_a_body_past_the_discard_bound_is_cut_off_with_a_413_that_closes(
    client: httpx.AsyncClient,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past DISCARD_BYTES over the limit, reading stops: 413 with Connection: close."""
    monkeypatch.setattr(receiver_limits, "DISCARD_BYTES", 2 * MIB)
    sender = Sender(100 * MIB)
    headers = github_request(b"", "d-endless")
    response = await client.post("/webhooks/github", content=sender.chunks(), headers=headers)
    assert_problem(response, 413, "payload-too-large")
    assert response.headers["connection"] == "close"
    assert LIMIT + 2 * MIB <= sender.sent <= LIMIT + 2 * MIB + 2 * CHUNK


async def test_a_body_declared_past_the_discard_bound_is_refused_unread(
    client: httpx.AsyncClient,  # noqa: F811
    publisher: CountingPublisher,  # noqa: F811
) -> None:
    """A Content-Length beyond limit + DISCARD_BYTES is not waited for: 413 at once, closing."""
    size = LIMIT + receiver_limits.DISCARD_BYTES + 1
    sender = Sender(size)
    headers = {**github_request(b"", "d-declared"), "Content-Length": str(size)}
    response = await client.post("/webhooks/github", content=sender.chunks(), headers=headers)
    assert_problem(response, 413, "payload-too-large")
    assert response.headers["connection"] == "close"
    assert sender.sent == 0
    assert publisher.published == []


async def test_a_refused_body_that_trickles_is_answered_once_the_discard_time_is_up(
    client: httpx.AsyncClient,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slow sender holds the request for DISCARD_S at most: then 413, closing."""
    monkeypatch.setattr(receiver_limits, "DISCARD_S", 0.5)
    sender = Sender(LIMIT + 200 * CHUNK, pause_s=0.05)  # 10 s if it were all read
    headers = github_request(b"", "d-slow")
    started = time.monotonic()
    response = await client.post("/webhooks/github", content=sender.chunks(), headers=headers)
    assert time.monotonic() - started < 5
    assert_problem(response, 413, "payload-too-large")
    assert response.headers["connection"] == "close"
    assert sender.sent < sender.size
