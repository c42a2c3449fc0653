"""The database's work per key: a new key (claim + complete) and a duplicate (claim again).

    .venv/bin/python -m bench.db_work [--n 10000] [--batch 500] [--every 4] [--database URL]

Through the real ClaimStore (`ClaimStore.open`, `claim_batch`, `complete`) on the local
PostgreSQL: N new keys claimed and completed in batches of B, then the same N keys claimed again
(every one a duplicate of a completed key). A fresh database per run (dropped afterwards; or
--database, an existing migrated one) and a scope of its own, so nothing collides with other
users of a shared server.

PostgreSQL here is shared and pg_stat_statements is not loaded (it needs a restart), so
cluster-wide counters (pg_current_wal_lsn, pg_stat_wal, txid_current) would count everyone's
work. Instead every statement of one batch in `--every` is measured on its own: just before the
store sends it, the same statement with the same arguments runs on the same connection under
EXPLAIN (ANALYZE, BUFFERS, WAL) in a transaction that is rolled back, and that transaction also
reads what it consumed (txid_current_if_assigned, the position of the dedupe_claim_tokens
sequence, pg_stat_xact_user_tables for dedupe_claims); then the store's statement runs as
usual. The figures are per key of the measured batches:

- WAL bytes, records and full-page images (the statement's own; the commit record, a few dozen
  bytes per transaction, is not in them),
- shared buffers hit, read and dirtied (execution only: planning is left out, the store's
  prepared statements rarely plan),
- transaction ids assigned, sequence values drawn,
- rows updated, and how many of those were HOT.

Which statements are measured is found by their text: any named statement of
dedupe/sql/queries.sql the store sends, so the tool runs unchanged on a commit whose claim or
completion statements changed (or split in two). AFTER triggers' own work is not in EXPLAIN's
node counts (the claims' history trigger fires on no row of either phase).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402

from bench.harness import fresh_database  # noqa: E402
from dedupe.claims.records import ClaimRequest, Fence  # noqa: E402
from dedupe.claims.store import ClaimStore  # noqa: E402
from dedupe.sql import queries  # noqa: E402

EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, WAL, TIMING OFF, FORMAT JSON) "
SEQUENCE = "dedupe_claim_tokens"
TABLE = "dedupe_claims"


@dataclass
class Work:
    """What the measured statements of one name did, summed."""

    statements: int = 0
    keys: int = 0
    wal_bytes: int = 0
    wal_records: int = 0
    wal_fpi: int = 0
    hit: int = 0
    read: int = 0
    dirtied: int = 0
    written: int = 0
    xids: int = 0
    sequence: int = 0
    inserted: int = 0
    updated: int = 0
    hot: int = 0

    def add(self, other: Work) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class Meter:
    """Which batch is being measured, and what each named statement did in the measured ones."""

    names: dict[str, str]  # statement text -> its name in queries.sql
    keys: int = 0  # the keys of the batch being sent; 0: not measured
    phase: str = ""
    work: dict[tuple[str, str], Work] = field(default_factory=dict)
    unmeasured: set[str] = field(default_factory=set)

    async def measure(self, conn: Any, query: str, args: Sequence[Any]) -> None:
        if not self.keys:
            return
        name = self.names.get(query)
        if name is None:  # not a statement of queries.sql: named in the output, not measured
            self.unmeasured.add(" ".join(query.split())[:60])
            return
        done = await twin(conn, query, args)
        done.keys = self.keys
        self.work.setdefault((self.phase, name), Work()).add(done)


async def position(conn: Any) -> int | None:
    """How many values the token sequence has handed out (None: no such sequence)."""
    if await conn.fetchval("SELECT to_regclass($1)", SEQUENCE) is None:
        return None
    row = await conn.fetchrow(f"SELECT last_value, is_called FROM {SEQUENCE}")
    return int(row["last_value"]) - (0 if row["is_called"] else 1)


async def twin(conn: Any, query: str, args: Sequence[Any]) -> Work:
    """Run `query` under EXPLAIN (ANALYZE, BUFFERS, WAL) in a transaction rolled back, with
    what that transaction consumed."""
    tx = conn.transaction()
    await tx.start()
    try:
        before, counted = await position(conn), await tuples(conn)
        plan = counts(json.loads(await conn.fetchval(EXPLAIN + query, *args))[0]["Plan"])
        xid = await conn.fetchval("SELECT txid_current_if_assigned()")
        after, rows = await position(conn), await tuples(conn)
    finally:
        await tx.rollback()
    return Work(
        statements=1,
        wal_bytes=int(plan.get("WAL Bytes", 0)),
        wal_records=int(plan.get("WAL Records", 0)),
        wal_fpi=int(plan.get("WAL FPI", 0)),
        hit=int(plan.get("Shared Hit Blocks", 0)),
        read=int(plan.get("Shared Read Blocks", 0)),
        dirtied=int(plan.get("Shared Dirtied Blocks", 0)),
        written=int(plan.get("Shared Written Blocks", 0)),
        xids=0 if xid is None else 1,
        sequence=(after - before) if after is not None and before is not None else 0,
        inserted=rows[0] - counted[0],
        updated=rows[1] - counted[1],
        hot=rows[2] - counted[2],
    )


def counts(top: dict[str, Any]) -> dict[str, int]:
    """The statement's counts from its plan: the top node's (they include its children's), or
    the sum of its ModifyTable nodes' where larger: a data-modifying CTE that the query does
    not read to its end is run to its end after the top node, outside its counts."""
    keys = (
        "WAL Bytes",
        "WAL Records",
        "WAL FPI",
        "Shared Hit Blocks",
        "Shared Read Blocks",
        "Shared Dirtied Blocks",
        "Shared Written Blocks",
    )
    modify: list[dict[str, Any]] = []
    nodes = [top]
    while nodes:
        node = nodes.pop()
        if node.get("Node Type") == "ModifyTable":
            modify.append(node)
        nodes.extend(node.get("Plans", []))
    return {k: max(int(top.get(k, 0)), sum(int(m.get(k, 0)) for m in modify)) for k in keys}


async def tuples(conn: Any) -> tuple[int, int, int]:
    """The claims table's rows inserted, updated and HOT-updated that this backend has not yet
    reported (pg_stat_xact_user_tables: earlier transactions' counts too, until the backend
    flushes them; a difference taken inside one transaction is its statement's own)."""
    row = await conn.fetchrow(
        "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
        " WHERE relid = to_regclass($1)",
        TABLE,
    )
    if row is None:
        return (0, 0, 0)
    return (int(row["n_tup_ins"]), int(row["n_tup_upd"]), int(row["n_tup_hot_upd"]))


class MeteredConnection:
    """A pooled connection whose statements are measured (`Meter.measure`) before they run."""

    def __init__(self, conn: Any, meter: Meter) -> None:
        self._conn = conn
        self._meter = meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        await self._meter.measure(self._conn, query, args)
        return await self._conn.fetch(query, *args, **kwargs)

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        await self._meter.measure(self._conn, query, args)
        return await self._conn.fetchrow(query, *args, **kwargs)

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        await self._meter.measure(self._conn, query, args)
        return await self._conn.fetchval(query, *args, **kwargs)

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        if args:  # a statement without arguments may be several; the store sends none here
            await self._meter.measure(self._conn, query, args)
        return await self._conn.execute(query, *args, **kwargs)


class MeteredPool:
    """The store's pool, lending metered connections (everything else is the pool's own)."""

    def __init__(self, pool: asyncpg.Pool, meter: Meter) -> None:
        self._pool = pool
        self._meter = meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def acquire(self, **kwargs: Any) -> Lending:
        return Lending(self, kwargs)

    async def release(self, conn: Any, **kwargs: Any) -> None:
        raw = conn._conn if isinstance(conn, MeteredConnection) else conn
        await self._pool.release(raw, **kwargs)

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        async with self.acquire() as conn:
            return await conn.fetch(query, *args, **kwargs)

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        async with self.acquire() as conn:
            return await conn.fetchrow(query, *args, **kwargs)

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        async with self.acquire() as conn:
            return await conn.fetchval(query, *args, **kwargs)

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        async with self.acquire() as conn:
            return await conn.execute(query, *args, **kwargs)


class Lending:
    """`pool.acquire()` as asyncpg's: `async with` it, or await it and release the connection."""

    def __init__(self, pool: MeteredPool, kwargs: dict[str, Any]) -> None:
        self._pool = pool
        self._kwargs = kwargs
        self._conn: MeteredConnection | None = None

    async def _take(self) -> MeteredConnection:
        conn = await self._pool._pool.acquire(**self._kwargs)
        return MeteredConnection(conn, self._pool._meter)

    def __await__(self) -> Any:
        return self._take().__await__()

    async def __aenter__(self) -> MeteredConnection:
        self._conn = await self._take()
        return self._conn

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            await self._pool.release(self._conn)
            self._conn = None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        url = args.database or await stack.enter_async_context(fresh_database())
        scope = f"bench.db_work.{uuid.uuid4().hex[:12]}"
        meter = Meter(names={text: name for name, text in queries().items()})
        store = await stack.enter_async_context(
            ClaimStore.open(url, owner=f"bench-db-work-{scope[-12:]}", min_size=1, max_size=2)
        )
        store.pool = cast(asyncpg.Pool, MeteredPool(store.pool, meter))
        requests = [
            ClaimRequest(scope, f"k{i:08d}", b"h" * 32) for i in range(args.n)
        ]  # the raw scheme: a 32-byte hash, no kept payload (as most handlers claim)
        batches = [requests[i : i + args.batch] for i in range(0, args.n, args.batch)]
        every = max(1, args.every)
        spans: dict[str, float] = {}
        outcomes: dict[str, Any] = {}

        began = time.perf_counter()
        meter.phase = "new"
        completed = 0
        for number, batch in enumerate(batches):
            meter.keys = len(batch) if number % every == 0 else 0
            claims = await store.claim_batch(batch, lease_s=60.0, retention_s=3600.0)
            fences = [Fence(c.scope, c.key, c.token) for c in claims if c.token is not None]
            if len(fences) != len(batch):
                raise RuntimeError(f"{len(batch) - len(fences)} new keys were not claimed")
            done = await store.complete([(f, "null", 3600.0) for f in fences])
            completed += len(done)
        spans["new"] = time.perf_counter() - began
        outcomes["new"] = {"claimed": args.n, "completed": completed}

        began = time.perf_counter()
        meter.phase = "duplicate"
        found = 0
        for number, batch in enumerate(batches):
            meter.keys = len(batch) if number % every == 0 else 0
            claims = await store.claim_batch(batch, lease_s=60.0, retention_s=3600.0)
            taken = [c for c in claims if c.token is not None]
            if taken:
                raise RuntimeError(f"{len(taken)} completed keys were claimed again")
            found += sum(1 for c in claims if c.status == "completed")
        if found != args.n:
            raise RuntimeError(f"{args.n - found} of {args.n} duplicates were not found completed")
        spans["duplicate"] = time.perf_counter() - began
        outcomes["duplicate"] = {"claimed": args.n, "found_completed": found}
        meter.keys = 0
        version = await store.pool.fetchval("SHOW server_version")

    return {
        "n": args.n,
        "batch": args.batch,
        "every": every,
        "postgres": version,
        "outcomes": outcomes,
        "wall_s": {k: round(v, 2) for k, v in spans.items()},
        "unmeasured": sorted(meter.unmeasured),
        "work": [
            {"phase": phase, "statement": name, **vars(work)}
            for (phase, name), work in meter.work.items()
        ],
    }


def per_key(work: Work) -> dict[str, float]:
    k = work.keys or 1
    return {f.name: getattr(work, f.name) / k for f in fields(work) if f.name != "keys"}


def table(result: dict[str, Any]) -> str:
    """The Markdown table: one row per phase and statement, then each phase's total."""
    rows: list[tuple[str, Work]] = []
    totals: dict[str, Work] = {}
    for item in result["work"]:
        work = Work(**{f.name: item[f.name] for f in fields(Work)})
        rows.append((f"{item['phase']}: {item['statement']}", work))
        total = totals.setdefault(item["phase"], Work())
        keys = total.keys
        total.add(work)
        # The statements of one phase measure the same keys: a key is counted once.
        total.keys = max(keys, work.keys)
        total.statements = max(total.statements, work.statements)
    for phase, total in totals.items():
        if sum(1 for item in result["work"] if item["phase"] == phase) > 1:
            rows.append((f"**{phase} key, all statements**", total))
    lines = [
        f"N={result['n']:,} keys in batches of {result['batch']}, one batch in "
        f"{result['every']} measured (EXPLAIN ANALYZE in a rolled-back transaction), "
        f"PostgreSQL {result['postgres']}; per key:",
        "",
        "| phase: statement | keys measured | WAL bytes | WAL records | FPI | buffers hit | "
        "read | dirtied | xids | sequence values | rows updated (HOT) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, work in rows:
        p = per_key(work)
        hot = f"{p['updated']:.2f} ({work.hot:,} of {work.updated:,} HOT)" if work.updated else "0"
        lines.append(
            f"| {label} | {work.keys:,} | {p['wal_bytes']:.1f} | {p['wal_records']:.2f} | "
            f"{p['wal_fpi']:.3f} | {p['hit']:.2f} | {p['read']:.3f} | {p['dirtied']:.3f} | "
            f"{p['xids']:.4f} | {p['sequence']:.2f} | {hot} |"
        )
    lines.append("")
    if result["unmeasured"]:
        lines.append("Not measured (not in queries.sql): " + "; ".join(result["unmeasured"]))
        lines.append("")
    lines.append(
        "(wall time of the phases with the measuring: "
        + ", ".join(f"{k} {v} s" for k, v in result["wall_s"].items())
        + ")"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=10000, help="keys")
    parser.add_argument("--batch", type=int, default=500, help="keys per claim statement")
    parser.add_argument("--every", type=int, default=4, help="measure one batch in this many")
    parser.add_argument("--database", help="an existing migrated database (default: a fresh one)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    args.n = max(1, min(args.n, 1_000_000))
    args.batch = max(1, args.batch)
    result = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
