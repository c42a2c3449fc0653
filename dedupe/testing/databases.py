"""Throwaway databases for dedupe.testing: a migrated template per server and schema, made once
per process, cloned for each run (CREATE DATABASE ... TEMPLATE copies files: fast); the claims
read back from one.

Names carry the pid of the process that made them, so that a later process on the same machine
drops those a killed test run left behind.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from dedupe.claims.database import migrate, redact
from dedupe.errors import ConfigurationError

logger = logging.getLogger(__name__)

# The tables a handler writes besides the claims: SQL run once on the template, or an async
# callable given the template's URL (an app's own `setup(dsn)`).
Schema = str | Callable[[str], Awaitable[None]]

_PREFIX = "dedupe_kit_"
_ORPHAN = re.compile(r"^dedupe_kit_(?:tpl_)?([0-9]+)_[0-9a-f]+$")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")

_templates: dict[tuple[str, object], str] = {}  # (server URL, schema) -> template name
_servers_tidied: set[str] = set()
_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)
_atexit_registered = False


def database_url(server_url: str, name: str) -> str:
    """The URL of database `name` on the server of `server_url` (same user, host, options)."""
    parts = urlsplit(server_url)
    return urlunsplit(parts._replace(path=f"/{name}"))


async def create_database(server_url: str, schema: Schema | None = None) -> str:
    """A new database cloned from the migrated template for (server, schema); its URL."""
    template = await _template(server_url, schema)
    name = f"{_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    admin = await _admin(server_url)
    try:
        # Autovacuum may visit the template for a moment ("being accessed by other users").
        await _execute_retrying(
            admin,
            f'CREATE DATABASE "{name}" TEMPLATE "{template}"',
            refused=asyncpg.ObjectInUseError,
            attempts=20,
            pause_s=0.25,
        )
    finally:
        await admin.close()
    return database_url(server_url, name)


async def drop_database(server_url: str, url: str) -> None:
    """Drop a database create_database made on that server, whoever is still connected to it."""
    name = urlsplit(url).path.lstrip("/")
    if not name.startswith(_PREFIX):
        raise ValueError(f"{name!r} was not made by dedupe.testing; not dropping it")
    admin = await _admin(server_url)
    try:
        await drop_forced(admin, name)
    finally:
        await admin.close()


async def drop_forced(admin: asyncpg.Connection, name: str) -> None:
    """DROP DATABASE ... WITH (FORCE), tried again while PostgreSQL refuses it to a role that is
    not a superuser ("must be a member of the role whose process is being terminated"): most
    likely an autovacuum worker in the database, which it cannot terminate for us and which is
    done within seconds."""
    await _execute_retrying(
        admin,
        f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
        refused=asyncpg.InsufficientPrivilegeError,
        attempts=40,
        pause_s=0.5,
    )


async def _execute_retrying(
    admin: asyncpg.Connection,
    sql: str,
    *,
    refused: type[asyncpg.PostgresError],
    attempts: int,
    pause_s: float,
) -> None:
    """Run `sql`, again after `pause_s` each time PostgreSQL refuses it with `refused`, a
    refusal that passes by itself; the last refusal is raised."""
    for attempt in range(attempts):
        try:
            await admin.execute(sql)
            return
        except refused:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(pause_s)


async def drop_templates() -> None:
    """Drop the templates this process made (the pytest plugin does it at the session's end)."""
    while _templates:
        (server_url, _), name = _templates.popitem()
        with contextlib.suppress(OSError, asyncpg.PostgresError, ConfigurationError):
            admin = await _admin(server_url)
            try:
                await drop_forced(admin, name)
            finally:
                await admin.close()


def _drop_templates_at_exit() -> None:
    if _templates:
        with contextlib.suppress(Exception):
            asyncio.run(drop_templates())


async def _template(server_url: str, schema: Schema | None) -> str:
    global _atexit_registered
    loop = asyncio.get_running_loop()
    lock = _locks.setdefault(loop, asyncio.Lock())
    async with lock:
        name = _templates.get((server_url, schema))
        if name is not None:
            return name
        name = f"{_PREFIX}tpl_{os.getpid()}_{secrets.token_hex(4)}"
        admin = await _admin(server_url)
        try:
            if server_url not in _servers_tidied:
                _servers_tidied.add(server_url)
                await _drop_orphans(admin, server_url)
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        try:
            url = database_url(server_url, name)
            await migrate(url)
            if isinstance(schema, str):
                conn = await asyncpg.connect(url)
                try:
                    await conn.execute(schema)
                finally:
                    await conn.close()
            elif schema is not None:
                await schema(url)
        except BaseException:
            admin = await _admin(server_url)
            try:
                await drop_forced(admin, name)
            finally:
                await admin.close()
            raise
        _templates[(server_url, schema)] = name
        if not _atexit_registered:
            atexit.register(_drop_templates_at_exit)
            _atexit_registered = True
        return name


async def _admin(url: str) -> asyncpg.Connection:
    """A connection for CREATE and DROP DATABASE, with an error that says what is needed."""
    try:
        return await asyncpg.connect(url, timeout=10)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise ConfigurationError(
            f"dedupe.testing cannot reach PostgreSQL at {redact(url)}: {exc}. Give the URL "
            "of a database whose role may CREATE DATABASE (DEDUPE_TEST_DATABASE_URL for the "
            "pytest plugin)."
        ) from exc


async def _drop_orphans(admin: asyncpg.Connection, server_url: str) -> None:
    """Drop the databases of processes on this machine that died before cleaning up."""
    if urlsplit(server_url).hostname not in _LOOPBACK:
        return  # another machine's pids mean nothing here
    names = await admin.fetch("SELECT datname FROM pg_database WHERE datname LIKE 'dedupe_kit_%'")
    for (name,) in names:
        match = _ORPHAN.match(name)
        if match is None or int(match[1]) == os.getpid() or _alive(int(match[1])):
            continue
        with contextlib.suppress(asyncpg.PostgresError):
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            logger.info("dropped %s, left behind by a test process that died", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class ClaimRow:
    """A row of the claims table, its result decoded."""

    scope: str
    key: str
    status: str
    attempts: int
    owner: str
    token: int
    result: Any
    reason: str | None  # a failed claim's reason (handler_error, rejected, ...)
    error: str | None  # its detail; an in-progress claim's last retried error
    lease_live: bool


async def read_claims(db: asyncpg.Pool | asyncpg.Connection) -> list[ClaimRow]:
    """The claims table, oldest first."""
    rows = await db.fetch(
        "SELECT scope, key, status, attempts, owner, token, result, reason, error,"
        " coalesce(lease_until > now(), false) AS lease_live"
        " FROM dedupe_claims ORDER BY created_at, scope, key"
    )
    return [
        ClaimRow(
            **{**dict(row), "result": None if row["result"] is None else json.loads(row["result"])}
        )
        for row in rows
    ]


__all__ = [
    "ClaimRow",
    "Schema",
    "create_database",
    "database_url",
    "drop_database",
    "drop_forced",
    "drop_templates",
    "read_claims",
]
