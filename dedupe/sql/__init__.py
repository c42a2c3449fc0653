"""Named SQL queries and numbered migrations, loaded from package data."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@cache
def queries(file: str = "queries.sql") -> dict[str, str]:
    """Parse `queries.sql` (or another file of named queries) into {name: statement}."""
    text = resources.files(__package__).joinpath(file).read_text("utf-8")
    found: dict[str, str] = {}
    parts = _NAME.split(text)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        found[name] = body.strip().rstrip(";")
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
