"""The wheel a user installs: built from this checkout, installed with an extra into a clean
virtualenv and run from a directory outside the repository, so nothing of the checkout is
importable there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import ROOT

# Slow (a build, a virtualenv and pip fetching the dependencies from the index): `-m "not wheel"`
# leaves it out. The timeout covers the module's fixtures, which run in the first test.
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(900)]

EXAMPLES = ("handlers", "tests", "bench", "scripts")  # in the repository, not in the wheel
# What a build must not see: an earlier in-tree build's build/lib is packed into the next wheel
# as it stands, files the configuration now leaves out included.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".services", ".cache"
)


def clean_environment() -> dict[str, str]:
    """This process's environment without what would put the checkout or our venv in reach."""
    hidden = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"}
    return {k: v for k, v in os.environ.items() if k not in hidden and not k.startswith("DEDUPE_")}


def run(command: list[str], *, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a command to completion without a terminal; fail with its output if it fails."""
    result = subprocess.run(
        command,
        cwd=cwd,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built by pip from a copy of the checkout (pip builds in the source tree)."""
    source = tmp_path_factory.mktemp("source") / "dedupe-worker"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheelhouse")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check"]
    run([*pip_wheel, "--quiet", "-w", str(out), str(source)], cwd=out, timeout_s=300)
    (built,) = out.glob("dedupe_worker-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A clean virtualenv (no system site-packages) with the wheel and its [rabbitmq] extra."""
    home = tmp_path_factory.mktemp("venv") / "env"
    run([sys.executable, "-m", "venv", str(home)], cwd=home.parent, timeout_s=120)
    pip = [str(home / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    run([*pip, "--quiet", f"{wheel}[rabbitmq]"], cwd=home.parent, timeout_s=600)
    return home


def test_the_wheel_holds_dedupe_with_its_sql_and_the_transports_but_not_the_example_apps(
    wheel: Path,
) -> None:
    """Top-level packages dedupe and the three transports; every .sql file and py.typed; no
    handlers/ and no generic `consumers` package."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert tops == {"dedupe", "dedupe_kafka", "dedupe_rabbitmq", "dedupe_receiver"}
    for folder in EXAMPLES:
        assert not [name for name in names if name.startswith(f"{folder}/")], folder
    sql = {path.relative_to(ROOT).as_posix() for path in (ROOT / "dedupe" / "sql").rglob("*.sql")}
    assert len(sql) >= 3
    assert sql <= names, sorted(sql - names)
    typed = {f"{top}/py.typed" for top in tops}
    assert {*typed, "dedupe/cli/__main__.py", "dedupe/testing/plugin.py"} <= names


async def test_the_installed_wheel_migrates_a_database_from_outside_the_repository(
    venv: Path, db_url: str, tmp_path: Path
) -> None:
    """`dedupe-worker --help` and `migrate` run from the venv's script in a foreign directory."""
    # db_url is cloned from a migrated template: empty it, so that every migration is applied
    # from the .sql files inside the wheel.
    db = await asyncpg.connect(db_url)
    try:
        await db.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        await db.close()
    script = str(venv / "bin" / "dedupe-worker")

    helped = run([script, "--help"], cwd=tmp_path, timeout_s=60)
    assert helped.stdout.startswith("usage: dedupe-worker ")
    migrated = run([script, "migrate", "--database", db_url], cwd=tmp_path, timeout_s=60)

    expected = sorted(p.stem for p in (ROOT / "dedupe" / "sql" / "migrations").glob("*.sql"))
    assert migrated.stdout.startswith(f"applied {len(expected)} migration(s): ")
    db = await asyncpg.connect(db_url)
    try:
        rows = await db.fetch("SELECT version, name FROM dedupe_migrations ORDER BY version")
        claims = await db.fetchval("SELECT to_regclass('dedupe_claims') IS NOT NULL")
    finally:
        await db.close()
    assert [f"{row['version']:04d}_{row['name']}" for row in rows] == expected
    assert claims
    again = run([script, "migrate", "--database", db_url], cwd=tmp_path, timeout_s=60)
    assert again.stdout.strip() == "database is up to date"


def test_the_installed_wheel_installs_only_names_that_start_with_dedupe(
    venv: Path, tmp_path: Path
) -> None:
    """A user's own `handlers` or `consumers` package would collide with ours: the wheel
    installs exactly dedupe and the three transports, each under a name that starts with it."""
    probe = (
        "import importlib, importlib.metadata, json\n"
        "imports = {}\n"
        "names = ('dedupe', 'dedupe.cli', 'dedupe_rabbitmq.transport', 'dedupe_kafka',\n"
        "         'dedupe_receiver', 'consumers', 'handlers')\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        imports[name] = 'ok'\n"
        "    except ModuleNotFoundError as exc:\n"
        "        imports[name] = f'no module {exc.name}'\n"
        "    except ImportError as exc:\n"  # a transport without its extra says which one
        "        imports[name] = str(exc).rpartition('pip install ')[2]\n"
        "files = importlib.metadata.files('dedupe-worker') or []\n"
        "tops = sorted({f.parts[0] for f in files if not f.parts[0].endswith('.dist-info')})\n"
        "print(json.dumps({'imports': imports, 'tops': tops}))\n"
    )
    result = run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, timeout_s=60)
    found = json.loads(result.stdout)
    assert found["imports"] == {
        "dedupe": "ok",
        "dedupe.cli": "ok",
        "dedupe_rabbitmq.transport": "ok",  # aio-pika came with the [rabbitmq] extra
        "dedupe_kafka": "'dedupe-worker[kafka]'",  # installed; its extra was not asked for
        "dedupe_receiver": "'dedupe-worker[receiver]'",
        "consumers": "no module consumers",
        "handlers": "no module handlers",
    }
    # What the distribution put in site-packages ("tests" alone could be another package's).
    tops = [top for top in found["tops"] if not top.startswith("..")]
    assert tops == ["dedupe", "dedupe_kafka", "dedupe_rabbitmq", "dedupe_receiver"]
