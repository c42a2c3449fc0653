"""PostgreSQL URLs that list several hosts (a primary and its standbys)."""

from __future__ import annotations

from typing import Any

import pytest

from dedupe.claims import database
from dedupe.claims.database import hosts_of, loopback_without_tls, session_options

MULTI = "postgresql://u:p@10.0.0.1:5432,10.0.0.2:5432/db"


def test_the_hosts_of_a_url_are_listed_without_their_ports() -> None:
    assert hosts_of(MULTI) == ["10.0.0.1", "10.0.0.2"]
    assert hosts_of("postgresql://u:p@[::1]:5432,localhost/db") == ["::1", "localhost"]
    assert hosts_of("postgresql://127.0.0.1/db") == ["127.0.0.1"]


def test_several_hosts_connect_to_the_one_that_takes_writes_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGTARGETSESSIONATTRS", raising=False)
    assert session_options(MULTI) == {"target_session_attrs": "read-write"}
    assert session_options("postgresql://u:p@10.0.0.1/db") == {}
    assert session_options(MULTI + "?target_session_attrs=prefer-standby") == {}
    monkeypatch.setenv("PGTARGETSESSIONATTRS", "any")
    assert session_options(MULTI) == {}


def test_tls_is_skipped_only_when_every_host_is_this_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGSSLMODE", raising=False)
    assert loopback_without_tls("postgresql://u:p@127.0.0.1:5432,localhost:5433/db")
    # Before, only the first host was looked at: a remote standby went without TLS.
    assert not loopback_without_tls("postgresql://u:p@127.0.0.1:5432,10.0.0.2:5432/db")


async def test_the_pool_is_asked_for_a_read_write_session_on_several_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGTARGETSESSIONATTRS", raising=False)
    seen: dict[str, Any] = {}

    async def create_pool(dsn: str, **kwargs: Any) -> object:
        seen.update(kwargs)
        return object()

    monkeypatch.setattr(database.asyncpg, "create_pool", create_pool)
    await database.connect_pool(MULTI)
    assert seen["target_session_attrs"] == "read-write"
