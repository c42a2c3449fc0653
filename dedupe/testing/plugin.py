"""The pytest11 entry point of dedupe.testing, inert unless enabled: it only registers the
`dedupe_testing` setting, and loads the fixtures when that is true. `-p dedupe.testing` loads
them without it (and works where plugin autoloading is off)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

FIXTURES = "dedupe.testing.fixtures"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "dedupe_testing",
        type="bool",
        default=False,
        help="load dedupe.testing's fixtures (dedupe_run, dedupe_database_url, ...)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getini("dedupe_testing"):
        config.pluginmanager.import_plugin(FIXTURES)
