"""A new project with the wheel and its [testing] extra in a clean virtualenv runs the example
test file of docs/testing.md against its PostgreSQL: it passes as written, and fails with the
check's table once its handler keys the provider call by a random UUID."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.test_wheel_install import clean_environment, run, wheel
from tests.conftest import ADMIN_URL
from tests.integration.test_testing_docs_example import example

# Slow (a build, a virtualenv and pip fetching the dependencies from the index).
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(900)]

__all__ = ["wheel"]  # the module-scoped fixture that builds the wheel


@pytest.fixture(scope="module")
def testing_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A clean virtualenv with the wheel and its [testing] extra, nothing else."""
    home = tmp_path_factory.mktemp("testing-venv") / "env"
    run([sys.executable, "-m", "venv", str(home)], cwd=home.parent, timeout_s=120)
    pip = [str(home / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    run([*pip, "--quiet", f"{wheel}[testing]"], cwd=home.parent, timeout_s=600)
    return home


def pytest_in_project(venv: Path, project: Path, source: str) -> subprocess.CompletedProcess[str]:
    (project / "test_payments.py").write_text(source)
    (project / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\nasyncio_default_fixture_loop_scope = "function"\n'
    )
    env = {**clean_environment(), "DEDUPE_TEST_DATABASE_URL": ADMIN_URL}
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-p", "dedupe.testing", "-q"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def test_the_docs_example_passes_in_a_project_with_the_testing_extra(
    testing_venv: Path, tmp_path: Path
) -> None:
    """Installed from the wheel, outside the repository: the five tests of the example pass."""
    result = pytest_in_project(testing_venv, tmp_path, example())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "5 passed" in result.stdout


def test_the_docs_example_fails_there_when_the_handler_is_made_non_idempotent(
    testing_venv: Path, tmp_path: Path
) -> None:
    """A random provider key: the crash after the handler and the zombie fail, with the table."""
    broken = (
        example()
        .replace("idempotency_key=ctx.key", "idempotency_key=str(uuid.uuid4())")
        .replace("from typing import Protocol\n", "import uuid\nfrom typing import Protocol\n", 1)
    )
    result = pytest_in_project(testing_venv, tmp_path, broken)
    assert result.returncode == 1, result.stdout[-4000:]
    assert "2 of 9 cases FAILED" in result.stdout
    assert "crash after handler  2 (a, b)  1            2 with 2 keys   acked    FAIL" in (
        result.stdout
    )
