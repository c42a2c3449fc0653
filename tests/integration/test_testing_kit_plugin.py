"""dedupe.testing's pytest plugin, in a pytest run of its own in a directory outside the
repository: installed, it adds nothing until enabled by `-p dedupe.testing` or by the
`dedupe_testing` setting; enabled, its fixtures run an app."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ADMIN_URL

USES_THE_FIXTURES = """
import pytest
from dedupe import App, Message

pytestmark = pytest.mark.asyncio


@pytest.fixture
def dedupe_app() -> App:
    app = App("plugged")

    @app.handler("jobs")
    async def work(message: Message) -> dict:
        return {"done": message.message_id}

    return app


async def test_a_message_is_done(dedupe_run, dedupe_recorder) -> None:
    dedupe_run.publish("jobs", b"{}", message_id="j-1")
    await dedupe_run.idle()
    assert await dedupe_run.result("j-1") == {"done": "j-1"}
    assert len(dedupe_recorder) == 0
"""


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run pytest in `folder` with this interpreter (dedupe installed), as a user would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUPE_", "PYTEST_"))}
    env["DEDUPE_TEST_DATABASE_URL"] = ADMIN_URL
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project of a user's: its own pytest configuration and a test using the fixtures."""
    (tmp_path / "test_jobs.py").write_text(USES_THE_FIXTURES)
    return tmp_path


def test_the_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    """pytest finds it installed: the entry point `dedupe` names dedupe.testing.plugin."""
    points = importlib.metadata.entry_points(group="pytest11")
    assert [p.value for p in points if p.name == "dedupe"] == ["dedupe.testing.plugin"]


def test_installed_but_not_enabled_the_plugin_adds_no_fixture(project: Path) -> None:
    """Without -p dedupe.testing or dedupe_testing = true, dedupe_run does not exist."""
    (project / "pytest.ini").write_text("[pytest]\n")
    result = pytest_in(project, "-q")
    assert result.returncode == 1, result.stdout
    assert "fixture 'dedupe_run' not found" in result.stdout
    listed = pytest_in(project, "--fixtures", "-q")
    assert "dedupe_run" not in listed.stdout and "dedupe_database_url" not in listed.stdout


def test_minus_p_dedupe_testing_enables_the_fixtures(project: Path) -> None:
    """`pytest -p dedupe.testing`: the fixtures run the app on a fresh database."""
    (project / "pytest.ini").write_text("[pytest]\n")
    result = pytest_in(project, "-q", "-p", "dedupe.testing")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_the_dedupe_testing_setting_enables_the_fixtures(project: Path) -> None:
    """`dedupe_testing = true` in the project's pytest configuration does the same."""
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [tool.pytest.ini_options]
            dedupe_testing = true
            """
        )
    )
    result = pytest_in(project, "-q", "-W", "error::pytest.PytestConfigWarning")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_without_a_database_url_the_fixture_says_what_to_set(project: Path) -> None:
    """No DEDUPE_TEST_DATABASE_URL: the test fails with the variable to set, not a traceback."""
    (project / "pytest.ini").write_text("[pytest]\n")
    env_less = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUPE_", "PYTEST_"))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "dedupe.testing"],
        cwd=project,
        env=env_less,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1
    assert "set DEDUPE_TEST_DATABASE_URL=" in result.stdout
