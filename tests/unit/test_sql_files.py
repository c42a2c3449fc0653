"""The SQL package data: named-query files, the numbered migrations and schema.sql each read as
what they are."""

from __future__ import annotations

from importlib import resources

import pytest

from dedupe.sql import SCHEMA_FILE, migrations, queries, schema


def test_schema_sql_is_never_read_as_named_queries() -> None:
    """schema.sql holds no `-- name:` block, and queries() refuses it rather than find none."""
    assert "-- name:" not in schema()
    with pytest.raises(ValueError, match="the whole schema"):
        queries(SCHEMA_FILE)


def test_every_named_query_file_names_its_queries() -> None:
    """Each .sql file beside schema.sql is a file of named queries, and holds some."""
    folder = resources.files("dedupe.sql")
    files = sorted(e.name for e in folder.iterdir() if e.name.endswith(".sql"))
    assert SCHEMA_FILE in files
    for name in files:
        if name != SCHEMA_FILE:
            assert queries(name), name


def test_schema_sql_is_not_a_migration() -> None:
    """The migration runner applies the numbered files alone."""
    assert all(name != "schema" for _, name, _ in migrations())
