"""Named SQL queries, numbered migrations and the whole schema, loaded from package data."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)

# The schema in one file (what the migrations build, for people to read): no named queries.
SCHEMA_FILE = "schema.sql"


@cache
def queries(file: str = "queries.sql") -> dict[str, str]:
    """Parse `queries.sql` (or another file of named queries) into {name: statement}."""
    if file == SCHEMA_FILE:
        raise ValueError(f"{SCHEMA_FILE} is the whole schema, not named queries: see schema()")
    text = resources.files(__package__).joinpath(file).read_text("utf-8")
    found: dict[str, str] = {}
    parts = _NAME.split(text)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        found[name] = body.strip().rstrip(";")
    if not found:
        raise ValueError(f"{file} holds no named query (`-- name: <query_name>` lines)")
    return found


def migrations() -> list[tuple[int, str, str]]:
    """Return (version, name, sql) of every numbered migration, in order."""
    folder = resources.files(__package__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text("utf-8")))
    return sorted(found)


def schema() -> str:
    """The text of `schema.sql`: the schema every migration builds, with the runner's record
    of them, as one script."""
    return resources.files(__package__).joinpath(SCHEMA_FILE).read_text("utf-8")
