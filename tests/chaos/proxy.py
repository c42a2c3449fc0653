"""A TCP fault proxy for the chaos tests: workers reach a service through it, and a test makes
the network between them slow, stalled or cut.

- `latency(s)`: every chunk is delivered `s` seconds after it arrived, each way, in order.
- `stall()`: nothing is delivered either way and nothing is closed, as when packets are
  swallowed on a path that is still up; the bytes wait in the proxy. `resume()` delivers them
  in order (the path healed) unless `cut()` came first.
- `cut()`: every open connection is reset (SO_LINGER 0, so the peers see ECONNRESET, not a
  clean end); new connections are taken as usual, unless `refuse=True`, which resets them at
  once until `heal()`.

It listens on 127.0.0.1 only and forwards to one target; it runs in the test's event loop. A
stall is bounded by the test, never by the proxy: the test calls resume() or cut().
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit


@dataclass(eq=False)
class _Pipe:
    """One direction of one connection: chunks waiting for their time, and the writer."""

    writer: asyncio.StreamWriter
    chunks: deque[tuple[float, bytes]] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False


@dataclass(eq=False)
class _Link:
    """One client connection and its connection to the target."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target`, with faults on demand."""

    def __init__(self, target_host: str, target_port: int, *, port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._listen_port = port
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._delay_s = 0.0
        self._stalled = asyncio.Event()  # set: stalled
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refuse = False
        self.connections = 0  # accepted so far
        self.resets = 0  # connections reset by cut() or refused

    @classmethod
    def of_url(cls, url: str) -> FaultProxy:
        """A proxy to the host and port of a service's URL (postgresql://, amqp://)."""
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        return cls(parts.hostname, parts.port)

    def url_for(self, url: str) -> str:
        """The same URL (credentials, path, query) pointing at this proxy instead."""
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        creds = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{creds}{self.address}"))

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._listen_port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        self._flowing.set()
        for link in list(self._links):
            self._reset(link)
        await asyncio.sleep(0)

    @property
    def port(self) -> int:
        assert self._server is not None, "the proxy is not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._links)

    # -- faults --------------------------------------------------------------------------

    def latency(self, delay_s: float) -> None:
        """Deliver every chunk `delay_s` after it arrived, each way (0: no delay)."""
        self._delay_s = max(0.0, delay_s)

    def stall(self) -> None:
        """Deliver nothing either way, close nothing, until resume() or cut()."""
        self._flowing.clear()

    def resume(self) -> None:
        """End a stall: what waited is delivered, in order."""
        self._flowing.set()

    def cut(self, *, refuse: bool = False) -> None:
        """Reset every open connection; with `refuse`, reset new ones too until heal()."""
        self._refuse = refuse
        for link in list(self._links):
            self._reset(link)
        self._flowing.set()

    def heal(self) -> None:
        """No fault: no delay, no stall, new connections accepted."""
        self._refuse = False
        self._delay_s = 0.0
        self._flowing.set()

    # -- forwarding ----------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self._refuse:
            _abort(writer)
            self.resets += 1
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _abort(writer)  # the service is down: the client sees the connection go
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(writer, up_writer)
        self._links.add(link)
        to_upstream, to_client = _Pipe(up_writer), _Pipe(writer)
        link.tasks = [
            asyncio.create_task(self._read(reader, to_upstream, link)),
            asyncio.create_task(self._read(up_reader, to_client, link)),
            asyncio.create_task(self._deliver(to_upstream, link)),
            asyncio.create_task(self._deliver(to_client, link)),
        ]

    async def _read(self, reader: asyncio.StreamReader, pipe: _Pipe, link: _Link) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                pipe.chunks.append((time.monotonic() + self._delay_s, data))
                pipe.ready.set()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            pipe.closed = True  # the other side's end, after what is queued
            pipe.ready.set()

    async def _deliver(self, pipe: _Pipe, link: _Link) -> None:
        try:
            while True:
                if not pipe.chunks:
                    if pipe.closed:
                        break
                    pipe.ready.clear()
                    await pipe.ready.wait()
                    continue
                await self._flowing.wait()
                due, data = pipe.chunks[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue  # a stall may have begun meanwhile
                pipe.chunks.popleft()
                pipe.writer.write(data)
                await pipe.writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            self._close(link)

    def _close(self, link: _Link) -> None:
        """One side ended: end the other too, cleanly (not a fault)."""
        if link not in self._links:
            return
        self._links.discard(link)
        for w in (link.client, link.upstream):
            with contextlib.suppress(Exception):
                w.close()
        for task in link.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def _reset(self, link: _Link) -> None:
        if link not in self._links:
            return
        self._links.discard(link)
        self.resets += 1
        for w in (link.client, link.upstream):
            _abort(w)
        for task in link.tasks:
            if task is not asyncio.current_task():
                task.cancel()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), as a dead path or a killed middlebox does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()
