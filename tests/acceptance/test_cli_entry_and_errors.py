"""The installed `dedupe-worker` script, errors in the user's module, options from the
environment: the real command as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.acceptance.conftest import run_cli

SCRIPT = Path(sys.executable).parent / "dedupe-worker"  # installed by `pip install -e .`


def test_the_installed_console_script_prints_the_help(tmp_path: Path) -> None:
    """The [project.scripts] entry point, run from outside the repository."""
    assert SCRIPT.exists(), f"{SCRIPT} is missing: pip install -e '.[dev]'"
    result = subprocess.run(
        [str(SCRIPT), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: dedupe-worker ")
    for command in ("run", "receive", "migrate", "gc", "claims", "status", "dlq"):
        assert f"\n    {command} " in result.stdout, command
    assert "DEDUPE_GC_BATCH_SIZE" in result.stdout  # the epilog on variables


def test_an_app_module_with_a_syntax_error_exits_1_naming_the_file_and_line(
    tmp_path: Path,
) -> None:
    (tmp_path / "broken_app.py").write_text("from dedupe import App\napp = App('shop'\nx = 1\n")
    result = run_cli("run", "broken_app:app", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1
    assert "broken_app.py:2: SyntaxError:" in result.stderr
    assert "fix that line" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_app_module_whose_dependency_is_missing_names_the_dependency(tmp_path: Path) -> None:
    (tmp_path / "needs_app.py").write_text("import json\nimport not_installed_dep\n")
    result = run_cli("receive", "needs_app:app", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1
    assert "needs_app.py:2: module 'needs_app' imports 'not_installed_dep'" in result.stderr
    assert "project's root" not in result.stderr
    assert "Traceback" not in result.stderr


async def test_an_option_of_one_command_is_read_from_its_environment_variable(
    db_url: str, db: asyncpg.Connection
) -> None:
    """claims list --limit from DEDUPE_CLAIMS_LIST_LIMIT; the command line still wins."""
    await db.execute(
        "INSERT INTO dedupe_claims (scope, key, payload_hash, status, owner, expires_at)"
        " SELECT 'shop.charge', 'k' || i, '\\x00', 'failed', 'w', now() + interval '1 day'"
        " FROM generate_series(1, 5) AS i"
    )
    env = {"DEDUPE_DATABASE_URL": db_url, "DEDUPE_CLAIMS_LIST_LIMIT": "2"}
    env["DEDUPE_CLAIMS_LIST_JSON"] = "true"
    from_env = run_cli("claims", "list", env=env)
    assert from_env.returncode == 0, from_env.stderr
    assert len(json.loads(from_env.stdout)) == 2
    given = run_cli("claims", "list", "--limit", "4", env=env)
    assert len(json.loads(given.stdout)) == 4
    bad = run_cli("claims", "list", env={**env, "DEDUPE_CLAIMS_LIST_LIMIT": "two"})
    assert bad.returncode == 2 and "DEDUPE_CLAIMS_LIST_LIMIT='two'" in bad.stderr
