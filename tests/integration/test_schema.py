"""schema.sql is the schema the migrations build: one fresh database migrated by the real runner,
another made from schema.sql, and their catalogs compared."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator

import asyncpg
import pytest

from dedupe.claims.database import migrate
from dedupe.sql import migrations, schema
from dedupe.testing.databases import database_url, drop_database
from tests.conftest import ADMIN_URL

# Our objects live in the schemas users create, never in PostgreSQL's own.
OURS = (
    "n.nspname NOT IN ('pg_catalog', 'information_schema')"
    " AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp\\_%'"
)

# What a database's schema is made of, one query per kind of object, each row one line of text.
# Lines are compared as sets: a table's columns may come in another order (schema.sql groups
# them by purpose, a migrated table has them in the order they were added); everything else
# must be the same, down to defaults, index predicates, storage options, comments and function
# bodies (whitespace aside).
CATALOG: dict[str, str] = {
    "relations": f"""
        SELECT format('%s %I.%I persistence=%s options=%s row_security=%s acl=%s%s',
                      c.relkind, n.nspname, c.relname, c.relpersistence, c.reloptions,
                      c.relrowsecurity, c.relacl,
                      CASE WHEN c.relkind IN ('v', 'm') THEN ' AS ' || pg_get_viewdef(c.oid) END)
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S') AND {OURS}""",
    "columns": f"""
        SELECT format('%I.%I.%I %s %s%s%s%s%s storage=%s%s',
                      n.nspname, c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
                      CASE WHEN a.attnotnull THEN 'NOT NULL' ELSE 'NULL' END,
                      ' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid),
                      CASE a.attidentity WHEN 'a' THEN ' IDENTITY ALWAYS'
                                         WHEN 'd' THEN ' IDENTITY BY DEFAULT' END,
                      CASE WHEN a.attgenerated <> '' THEN ' GENERATED' END,
                      ' COLLATE ' || co.collname, a.attstorage,
                      ' options=' || a.attoptions::text)
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
          LEFT JOIN pg_collation co
                 ON co.oid = a.attcollation AND a.attcollation <> 0
                    AND co.collname <> 'default'
         WHERE a.attnum > 0 AND NOT a.attisdropped
           AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND {OURS}""",
    "constraints": f"""
        SELECT n.nspname || '.' || coalesce(c.relname, t.typname, '-') || ' ' || k.conname
               || ' ' || pg_get_constraintdef(k.oid)
          FROM pg_constraint k
          JOIN pg_namespace n ON n.oid = k.connamespace
          LEFT JOIN pg_class c ON c.oid = k.conrelid
          LEFT JOIN pg_type t ON t.oid = k.contypid
         WHERE {OURS}""",
    "indexes": f"""
        SELECT pg_get_indexdef(i.indexrelid)
               || CASE WHEN i.indisclustered THEN ' CLUSTERED' ELSE '' END
               || CASE WHEN i.indisreplident THEN ' REPLICA IDENTITY' ELSE '' END
          FROM pg_index i
          JOIN pg_class c ON c.oid = i.indexrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE {OURS}""",
    "sequences": """
        SELECT s.schemaname || '.' || s.sequencename || ' ' || s.data_type::text
               || ' start ' || s.start_value || ' min ' || s.min_value
               || ' max ' || s.max_value || ' increment ' || s.increment_by
               || ' cache ' || s.cache_size || CASE WHEN s.cycle THEN ' cycle' ELSE '' END
               || coalesce(' owned by ' || (
                      SELECT t.relname || '.' || a.attname
                        FROM pg_depend dep
                        JOIN pg_class t ON t.oid = dep.refobjid
                        JOIN pg_attribute a
                             ON a.attrelid = dep.refobjid AND a.attnum = dep.refobjsubid
                       WHERE dep.classid = 'pg_class'::regclass
                         AND dep.objid = (quote_ident(s.schemaname) || '.'
                                          || quote_ident(s.sequencename))::regclass
                         AND dep.refobjsubid > 0 AND dep.deptype IN ('a', 'i')), '')
          FROM pg_sequences s
         WHERE s.schemaname NOT IN ('pg_catalog', 'information_schema')""",
    "functions": f"""
        SELECT regexp_replace(pg_get_functiondef(p.oid), '\\s+', ' ', 'g')
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE p.prokind IN ('f', 'p') AND {OURS}""",
    "triggers": f"""
        SELECT format('%s enabled=%s', pg_get_triggerdef(g.oid), g.tgenabled)
          FROM pg_trigger g
          JOIN pg_class c ON c.oid = g.tgrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE NOT g.tgisinternal AND {OURS}""",
    "types": f"""
        SELECT format('%I.%I %s%s%s', n.nspname, t.typname, t.typtype,
                      CASE WHEN t.typtype = 'd'
                           THEN ' ' || format_type(t.typbasetype, t.typtypmod) END,
                      ' (' || (SELECT string_agg(e.enumlabel, ', ' ORDER BY e.enumsortorder)
                                 FROM pg_enum e WHERE e.enumtypid = t.oid) || ')')
          FROM pg_type t
          JOIN pg_namespace n ON n.oid = t.typnamespace
          LEFT JOIN pg_class c ON c.oid = t.typrelid
         WHERE (t.typtype IN ('e', 'd', 'r', 'm') OR c.relkind = 'c') AND {OURS}""",
    "rules and policies": """
        SELECT 'rule ' || schemaname || '.' || tablename || '.' || rulename || ' ' || definition
          FROM pg_rules WHERE schemaname NOT IN ('pg_catalog', 'information_schema')
        UNION ALL
        SELECT 'policy ' || schemaname || '.' || tablename || '.' || policyname || ' '
               || cmd || ' ' || coalesce(qual, '-') || ' ' || coalesce(with_check, '-')
          FROM pg_policies""",
    "extensions": "SELECT extname || ' ' || extversion FROM pg_extension",
    # Objects made by users have oids from 16384 up (FirstNormalObjectId): the comments on them.
    "comments": """
        SELECT pg_describe_object(d.classoid, d.objoid, d.objsubid) || ': ' || d.description
          FROM pg_description d
         WHERE d.objoid >= 16384""",
}

# The runner's bookkeeping rows: schema.sql records the migrations it stands for.
APPLIED = """
    SELECT 'migration ' || to_char(version, 'FM0000') || '_' || name
      FROM dedupe_migrations"""


async def catalog(url: str) -> dict[str, set[str]]:
    """The schema of the database at `url`, as lines of text per kind of object."""
    conn = await asyncpg.connect(url)
    try:
        described = {
            kind: {row[0] for row in await conn.fetch(sql)} for kind, sql in CATALOG.items()
        }
        if await conn.fetchval("SELECT to_regclass('dedupe_migrations') IS NOT NULL"):
            described["applied migrations"] = {row[0] for row in await conn.fetch(APPLIED)}
        return described
    finally:
        await conn.close()


def differences(migrated: dict[str, set[str]], loaded: dict[str, set[str]]) -> str:
    """What differs, per kind of object: the lines only one side has."""
    out: list[str] = []
    for kind in sorted(migrated.keys() | loaded.keys()):
        before, after = migrated.get(kind, set()), loaded.get(kind, set())
        if before == after:
            continue
        out.append(f"{kind}:")
        out += [f"  - only after the migrations: {line}" for line in sorted(before - after)]
        out += [f"  + only after schema.sql:      {line}" for line in sorted(after - before)]
    return "\n".join(out)


@pytest.fixture
async def fresh_databases(_test_databases: None) -> AsyncIterator[tuple[str, str]]:
    """Two empty databases (CREATE DATABASE from the server's default template), dropped at
    the end; named as dedupe.testing names its own, so a killed run's are tidied up later."""
    admin = await asyncpg.connect(ADMIN_URL)
    urls: list[str] = []
    try:
        for _ in range(2):
            name = f"dedupe_kit_{os.getpid()}_{secrets.token_hex(4)}"
            await admin.execute(f'CREATE DATABASE "{name}"')
            urls.append(database_url(ADMIN_URL, name))
    finally:
        await admin.close()
    try:
        yield urls[0], urls[1]
    finally:
        for url in urls:
            await drop_database(ADMIN_URL, url)


async def test_schema_sql_builds_what_the_migrations_build(
    fresh_databases: tuple[str, str],
) -> None:
    """Every table, column, constraint, index, sequence, function, trigger and comment is the
    same after all migrations (through `migrate`) as after schema.sql, and so is the record of
    the migrations applied."""
    migrated_url, loaded_url = fresh_databases
    applied = await migrate(migrated_url)
    assert applied == [f"{version:04d}_{name}" for version, name, _ in migrations()]
    conn = await asyncpg.connect(loaded_url)
    try:
        await conn.execute(schema())  # no arguments: the simple protocol, many statements
    finally:
        await conn.close()

    migrated, loaded = await catalog(migrated_url), await catalog(loaded_url)

    assert migrated["relations"], "the migrations built nothing: is the comparison blind?"
    found = differences(migrated, loaded)
    if found:
        pytest.fail(
            "dedupe/sql/schema.sql and the migrations build different schemas: a migration "
            "without its change in schema.sql, or the other way round.\n" + found,
            pytrace=False,
        )


async def test_a_database_made_from_schema_sql_is_up_to_date_for_the_runner(
    fresh_databases: tuple[str, str],
) -> None:
    """`dedupe-worker migrate` applies nothing to a database made from schema.sql."""
    _, url = fresh_databases
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(schema())
    finally:
        await conn.close()
    assert await migrate(url) == []
