"""dedupe.testing's DROP DATABASE ... WITH (FORCE): tried again while PostgreSQL refuses it."""

from __future__ import annotations

import asyncpg
import pytest

from dedupe.testing.databases import drop_forced


class Admin:
    """An admin connection whose first `refusals` DROPs are refused as PostgreSQL 15 does while
    an autovacuum worker is in the database."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.statements: list[str] = []

    async def execute(self, sql: str) -> str:
        self.statements.append(sql)
        if len(self.statements) <= self.refusals:
            raise asyncpg.InsufficientPrivilegeError(
                "must be a member of the role whose process is being terminated"
            )
        return "DROP DATABASE"


async def test_a_refused_drop_is_tried_again_until_it_succeeds() -> None:
    admin = Admin(refusals=2)
    await drop_forced(admin, "dedupe_test_x")  # type: ignore[arg-type]
    assert admin.statements == ['DROP DATABASE IF EXISTS "dedupe_test_x" WITH (FORCE)'] * 3


async def test_a_drop_refused_for_good_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_wait(_: float) -> None:
        return None

    monkeypatch.setattr("dedupe.testing.databases.asyncio.sleep", no_wait)
    admin = Admin(refusals=1000)
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await drop_forced(admin, "dedupe_test_x")  # type: ignore[arg-type]
    assert len(admin.statements) == 40
