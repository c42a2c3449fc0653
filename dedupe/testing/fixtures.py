"""The pytest fixtures of dedupe.testing, registered only when the plugin is enabled
(`-p dedupe.testing`, or `dedupe_testing = true` in the pytest configuration)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from dedupe.app import App
from dedupe.testing.databases import Schema, drop_templates
from dedupe.testing.recorder import Recorder
from dedupe.testing.run import TestRun

URL_VARIABLES = ("DEDUPE_TEST_DATABASE_URL", "DEDUPE_DATABASE_URL")


@pytest.fixture(scope="session")
def dedupe_database_url() -> str:
    """The PostgreSQL server runs make their databases on: DEDUPE_TEST_DATABASE_URL (or
    DEDUPE_DATABASE_URL); override the fixture to take it from elsewhere."""
    for name in URL_VARIABLES:
        url = os.environ.get(name)
        if url:
            return url
    pytest.fail(
        "dedupe.testing needs a PostgreSQL server: set DEDUPE_TEST_DATABASE_URL="
        "postgresql://user:password@127.0.0.1:5432/postgres (a role that may CREATE "
        "DATABASE), or override the dedupe_database_url fixture",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def dedupe_schema() -> Schema | None:
    """The app's own tables in every run's database (SQL, or an async setup(url)); override
    it in your conftest.py. None: the claims tables alone."""
    return None


@pytest.fixture
def dedupe_recorder() -> Recorder:
    """A fresh Recorder for the external calls of one test."""
    return Recorder()


@pytest_asyncio.fixture
async def dedupe_run(
    request: pytest.FixtureRequest, dedupe_database_url: str, dedupe_schema: Schema | None
) -> AsyncIterator[TestRun]:
    """A started TestRun of the App your `dedupe_app` fixture returns, on a fresh database."""
    try:
        app = request.getfixturevalue("dedupe_app")
    except pytest.FixtureLookupError:
        pytest.fail(
            "dedupe_run runs the App a `dedupe_app` fixture returns: define one in your "
            "conftest.py or test module",
            pytrace=False,
        )
    if not isinstance(app, App):
        pytest.fail(f"the dedupe_app fixture returned {app!r}, not a dedupe.App", pytrace=False)
    async with TestRun(app, database_url=dedupe_database_url, schema=dedupe_schema) as run:
        yield run


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Drop the templates the session made (each test's database is dropped by its run)."""
    asyncio.run(drop_templates())
