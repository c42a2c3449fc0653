"""The database connection: pools, the errors after which a statement may be sent again, the
errors that mean a value was refused, the numbered migrations and the schema gate."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg
from tenacity import RetryCallState
from tenacity.wait import wait_base

from dedupe.claims.values import storable_text
from dedupe.errors import SchemaMismatch, StoreError
from dedupe.sql import migrations, queries

logger = logging.getLogger(__name__)

GC_LOCK_ID = 0x6465_6475_7065  # "dedupe": one clean-up at a time across all workers
MIGRATE_LOCK_ID = GC_LOCK_ID + 1


def scheduled_wait(wait: wait_base, failed: int) -> float:
    """tenacity's wait after failed attempt number `failed`, without a retrier around the call:
    its schedule, not its per-call set-up (which costs more than a statement's own Python)."""
    state = RetryCallState(None, None, (), {})  # type: ignore[arg-type]  # no retrier
    state.attempt_number = failed
    return float(wait(state))


# Errors after which the same statement may simply be sent again.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ConnectionError,
    asyncpg.InterfaceError,
    # Raised by the pool when it resets a connection the server has just terminated.
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.QueryCanceledError,
)


# PostgreSQL refused a value, not the statement: SQLSTATE class 22 (data exception: NUL,
# invalid input, out of range; asyncpg raises it too for an argument it cannot encode) and 54
# (program limit exceeded: an index row too large, nesting too deep). A batched statement
# refused so is split until only the items carrying such a value are left out.
VALUE_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.DataError,
    asyncpg.ProgramLimitExceededError,
)


def redact(dsn: str) -> str:
    """The DSN without its password, fit for logs and error messages."""
    parts = urlsplit(dsn)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return dsn


def said(exc: BaseException) -> str:
    """What PostgreSQL (or asyncpg) said, on one line, fit for a header or a log."""
    return storable_text(" ".join(str(exc).split()), 300)


def literal(text: str) -> str:
    """`text` as an SQL string literal, for the few statements sent as simple queries (which
    take no parameters): an escape string (E'...'), whose backslashes and quotes are doubled,
    read alike whatever standard_conforming_strings says. asyncpg's connections speak UTF-8,
    and PostgreSQL refuses a NUL in any text, as it would as a parameter."""
    return "E'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def sql_value(value: str | bytes | float | None) -> str:
    """`value` as a literal of a simple query: NULL, an integer, a float (as a string, which
    its parameter's type reads: 'inf' too), a text (`literal`) or a bytea (its hex form)."""
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return literal(value)
    if isinstance(value, bytes):
        return literal("\\x" + value.hex())
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return literal(repr(value))
    raise TypeError(f"no SQL literal for {type(value).__name__}")


class StoreConnection(asyncpg.Connection):  # type: ignore[misc]
    """A pooled connection that skips the pool's reset after the store's own statements.

    asyncpg resets every released connection with one more round trip (advisory locks,
    cursors, LISTEN, session settings). The claim statements touch none of these, so the store
    marks the connection clean just before releasing it; a connection handed to a handler as
    `ctx.db`, or used for anything else, is never marked and is reset as usual.
    """

    _dedupe_clean = False
    # Whether this session has the statements of queries.sql's prepare_http_one_transaction.
    _dedupe_prepared = False

    def mark_clean(self) -> None:
        self._dedupe_clean = True

    def prepares(self) -> str:
        """The PREPAREs of the HTTP one-transaction statements (queries.sql,
        prepare_http_one_transaction), with their `;`, for the query that first EXECUTEs
        one on this session; then '' (marked prepared as it is returned: they lead the query,
        and a PREPARE stands whatever follows it, a rollback included)."""
        if self._dedupe_prepared:
            return ""
        self._dedupe_prepared = True
        return f"{_http_prepares()};\n"

    async def prepare_again(self) -> None:
        """The statements are not what this session was marked with (an endpoint's
        DEALLOCATE on its connection, a PREPARE sent that did not run): the transaction rolled
        back, ours that are left deallocated (simple queries: nothing of asyncpg's statement
        cache, which a DEALLOCATE ALL empties too, is used), and the next `prepares()` sends
        them again."""
        try:
            if self.is_in_transaction():
                await self.execute("ROLLBACK")
            for name in HTTP_STATEMENTS:
                with contextlib.suppress(asyncpg.InvalidSQLStatementNameError):
                    await self.execute(f"DEALLOCATE {name}")
        finally:
            self._dedupe_prepared = False


# The statements queries.sql's prepare_http_one_transaction prepares.
HTTP_STATEMENTS = ("dedupe_http_claim_v1", "dedupe_http_complete_v1")


@functools.cache
def _http_prepares() -> str:
    """prepare_http_one_transaction without its comment lines."""
    lines = queries()["prepare_http_one_transaction"].splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("--"))


# One transaction where one is enough (the workers' dedupe.pipeline.one_transaction and the
# HTTP middleware's dedupe.asgi.one_transaction): how long the claim waits for another
# transaction that holds its key (at most a third of the lease; then the key counts as in
# flight elsewhere), and how long after the run's bound PostgreSQL ends the session of a
# frozen process (idle in its transaction, or in one statement), which rolls its transaction
# back and frees the key.
LOCK_TIMEOUT_S = 2.0
SESSION_MARGIN_S = 1.0


@dataclass(frozen=True, slots=True)
class TransactionBounds:
    """A one-transaction run's bounds: the run's (seconds), the claim's lock wait, the
    session's timeouts (idle in the transaction, one statement)."""

    run_s: float
    lock_s: float
    session_s: float

    @classmethod
    def of(cls, lease_s: float, run_s: float | None = None) -> TransactionBounds:
        """The bounds of a run under `lease_s`, bounded by `run_s` (default: the lease)."""
        run_s = lease_s if run_s is None else run_s
        return cls(run_s, min(LOCK_TIMEOUT_S, lease_s / 3), run_s + SESSION_MARGIN_S)

    def begin(self) -> str:
        """BEGIN with the bounds, in one round trip (numbers only: no values)."""
        return f"BEGIN; {self.settings()}"

    def settings(self) -> str:
        """The bounds of a transaction already begun (SET LOCAL: they end with it)."""
        lock_ms, session_ms = max(1, int(self.lock_s * 1000)), max(1, int(self.session_s * 1000))
        return (
            f"SET LOCAL lock_timeout = {lock_ms}; "
            f"SET LOCAL idle_in_transaction_session_timeout = {session_ms}; "
            f"SET LOCAL statement_timeout = {session_ms}"
        )


async def _token_floor(conn: asyncpg.Connection) -> None:
    """Before a new connection's first statement: the token sequence past this timeline's
    floor, so that a standby promoted after an asynchronous failover never issues again a
    token the old primary issued (queries.sql, token_floor). Never fails the connection: a
    floor that could not be set is logged, with what to grant."""
    try:
        await conn.execute(queries()["token_floor"])
        status = await conn.fetchval("SELECT current_setting('dedupe.token_floor', true)")
    except asyncpg.PostgresError as exc:  # cut off by a statement_timeout, say
        status = f"{exc.sqlstate} {exc}"
    if status not in ("ok", "skipped"):
        logger.warning(
            "could not move dedupe_claim_tokens past this timeline's tokens (%s): after an "
            "asynchronous failover a token could be issued twice; grant SELECT, UPDATE on "
            "dedupe_claim_tokens to this role",
            status,
        )


async def _reset(conn: asyncpg.Connection) -> None:
    """The pool's reset, skipped for a connection the store marked clean."""
    if getattr(conn, "_dedupe_clean", False):
        conn._dedupe_clean = False
        return
    query = conn.get_reset_query()
    if query:
        await conn.execute(query)


def loopback_without_tls(dsn: str) -> bool:
    """Whether to connect without TLS: the host is this machine and nothing asks for TLS.

    asyncpg's default `sslmode=prefer` negotiates TLS even on 127.0.0.1, where it only costs
    CPU (measured in BENCHMARKS.md). An explicit sslmode in the URL or PGSSLMODE wins.
    """
    parts = urlsplit(dsn)
    if "sslmode" in parse_qs(parts.query) or os.environ.get("PGSSLMODE"):
        return False
    hosts = hosts_of(dsn)
    return bool(hosts) and all(host in ("127.0.0.1", "::1", "localhost") for host in hosts)


def hosts_of(dsn: str) -> list[str]:
    """The hosts a URL lists (`postgresql://u:p@h1:5432,h2:5432/db`), without their ports."""
    netloc = urlsplit(dsn).netloc.rsplit("@", 1)[-1]
    hosts = []
    for item in netloc.split(","):
        if item.startswith("["):  # [::1]:5432
            hosts.append(item[1 : item.find("]")])
        elif item:
            hosts.append(item.rsplit(":", 1)[0] if item.count(":") == 1 else item)
    return hosts


def session_options(dsn: str) -> dict[str, Any]:
    """A URL listing several hosts (a primary and its standbys) connects to the one that
    accepts writes: target_session_attrs=read-write unless the URL or PGTARGETSESSIONATTRS
    says otherwise. Every new connection of the pool tries the hosts in turn, so after a
    failover the pool finds the promoted standby by itself."""
    if len(hosts_of(dsn)) < 2:
        return {}
    if "target_session_attrs" in parse_qs(urlsplit(dsn).query):
        return {}
    if os.environ.get("PGTARGETSESSIONATTRS"):
        return {}
    return {"target_session_attrs": "read-write"}


def connect_options(dsn: str) -> dict[str, Any]:
    """asyncpg's options for a URL, the same for the pool and for migrate: no TLS to this
    machine unless asked for, the read-write host of several."""
    return {**({"ssl": False} if loopback_without_tls(dsn) else {}), **session_options(dsn)}


async def connect_pool(dsn: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """Create a pool or raise StoreError that says how to reach the database."""
    try:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=10,
            server_settings={"application_name": "dedupe-worker"},
            connection_class=StoreConnection,
            reset=_reset,
            init=_token_floor,
            **connect_options(dsn),
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise StoreError(
            f"cannot connect to PostgreSQL at {redact(dsn)}: {exc}. Is it running "
            "(`make services`)? Set the URL with --database or DEDUPE_DATABASE_URL."
        ) from exc
    assert pool is not None
    return pool


def _named(versions: dict[int, str]) -> str:
    return ", ".join(f"{version:04d}_{name}" for version, name in sorted(versions.items()))


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """The migrations a database records as applied, against those this code ships
    (dedupe/sql/migrations: the version needed is the last file's, never a constant)."""

    applied: dict[int, str] | None  # None: no dedupe_migrations table, never migrated
    known: dict[int, str]

    @classmethod
    def of(cls, applied: dict[int, str] | None) -> SchemaVersion:
        return cls(applied, {version: name for version, name, _ in migrations()})

    @property
    def needed(self) -> int:
        return max(self.known)

    @property
    def found(self) -> int | None:
        return max(self.applied) if self.applied else None

    @property
    def pending(self) -> dict[int, str]:
        done = self.applied or {}
        return {v: n for v, n in self.known.items() if v not in done}

    @property
    def unknown(self) -> dict[int, str]:
        """Migrations applied that this code does not have: a newer dedupe-worker's."""
        return {v: n for v, n in (self.applied or {}).items() if v not in self.known}

    def _version(self, version: int | None, names: dict[int, str]) -> str:
        if version is None:
            return "none (no migration recorded)"
        return f"{version} ({version:04d}_{names[version]})"

    def problem(self, where: str | None = None) -> str | None:
        """What is wrong for this code, with what to run; None when the schema is the one
        this code needs."""
        needed = self._version(self.needed, self.known)
        at = f" ({where})" if where else ""
        if self.applied is None:
            return (
                f"this database{at} was never migrated (it has no dedupe_migrations table): "
                f"run `dedupe-worker migrate` first; this dedupe-worker needs schema version "
                f"{needed}"
            )
        found = self._version(self.found, {**self.known, **self.applied})
        if self.unknown:
            return (
                f"the database's schema{at} is newer than this dedupe-worker: found version "
                f"{found}, with {_named(self.unknown)} unknown to this code, which needs version "
                f"{needed}. A newer dedupe-worker migrated it: run that version (upgrade this "
                "one); `dedupe-worker migrate` never takes a schema back"
            )
        if self.pending:
            return (
                f"the database's schema{at} is older than this dedupe-worker: found version "
                f"{found}, this code needs version {needed} ({len(self.pending)} migration(s) "
                f"pending: {_named(self.pending)}); run `dedupe-worker migrate`, then start again"
            )
        return None


_STORE_DOWN = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)


async def schema_version(db: Any) -> SchemaVersion:
    """Read the migrations applied (`db`: a pool or a connection); StoreError when the
    database cannot be asked."""
    try:
        if not await db.fetchval("SELECT to_regclass('dedupe_migrations') IS NOT NULL"):
            return SchemaVersion.of(None)
        rows = await db.fetch("SELECT version, name FROM dedupe_migrations")
    except _STORE_DOWN as exc:
        raise StoreError(f"cannot read the schema version: {said(exc)}") from exc
    return SchemaVersion.of({row["version"]: row["name"] for row in rows})


async def check_schema(db: Any, *, where: str | None = None) -> SchemaVersion:
    """The gate every process that uses the store passes at start: raise SchemaMismatch
    (naming `dedupe-worker migrate`) unless the database has exactly the migrations this code
    ships. `where`: the database, redacted, for the message."""
    version = await schema_version(db)
    problem = version.problem(where)
    if problem is not None:
        raise SchemaMismatch(problem)
    try:
        claims_table = await db.fetchval("SELECT to_regclass('dedupe_claims') IS NOT NULL")
    except _STORE_DOWN as exc:
        raise StoreError(f"cannot read the schema: {said(exc)}") from exc
    if not claims_table:
        at = f" ({where})" if where else ""
        raise SchemaMismatch(
            f"this database{at} records every migration as applied, but its claims table "
            "dedupe_claims is missing (dropped by hand?): restore it from a backup, or drop "
            "the table dedupe_migrations and run `dedupe-worker migrate` to create the schema "
            "again"
        )
    return version


async def migrate(dsn: str, *, up_to: int | None = None) -> list[str]:
    """Apply the numbered migrations not yet applied (those up to version `up_to` alone, when
    given: a test's database as an older version left it); return the names applied."""
    applied: list[str] = []
    try:
        conn = await asyncpg.connect(dsn, timeout=10, **connect_options(dsn))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise StoreError(
            f"cannot connect to PostgreSQL at {redact(dsn)}: {exc}. Is it running "
            "(`make services`)? Set the URL with --database or DEDUPE_DATABASE_URL."
        ) from exc
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATE_LOCK_ID)
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS dedupe_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            rows = await conn.fetch("SELECT version, name FROM dedupe_migrations")
            done = {r["version"] for r in rows}
            newer = SchemaVersion.of({r["version"]: r["name"] for r in rows})
            if newer.unknown:
                raise SchemaMismatch(newer.problem(redact(dsn)))
            for version, name, sql in migrations():
                if version in done or (up_to is not None and version > up_to):
                    continue
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO dedupe_migrations (version, name) VALUES ($1, $2)", version, name
                )
                applied.append(f"{version:04d}_{name}")
    except asyncpg.PostgresError as exc:
        raise StoreError(f"migration failed: {exc}") from exc
    finally:
        await conn.close()
    return applied
