"""docs/testing.md's example test file, run as a user would (a folder outside the repository,
`pytest -p dedupe.testing`): it passes as written and fails with the check's table when its
handler is made non-idempotent, by a random key for the provider or an insert outside ctx.db."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ADMIN_URL, ROOT

DOCS = ROOT / "docs" / "testing.md"


def example() -> str:
    """The docs' code block that is the file test_payments.py."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    [found] = [block for block in blocks if block.startswith('"""test_payments.py')]
    return found


def run_example(folder: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (folder / "test_payments.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUPE_", "PYTEST_"))}
    env["DEDUPE_TEST_DATABASE_URL"] = ADMIN_URL
    return subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "dedupe.testing", "-p", "no:cacheprovider"),
            *("-o", "asyncio_default_fixture_loop_scope=function", "test_payments.py", *args),
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )


def test_the_docs_example_passes_as_written(tmp_path: Path) -> None:
    """Copied as it stands into an empty folder, every test of the example passes."""
    result = run_example(tmp_path, example(), "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout


def test_the_docs_example_fails_when_the_provider_gets_a_random_key(tmp_path: Path) -> None:
    """idempotency_key=str(uuid.uuid4()): the check fails the crash after the handler and the
    zombie, with two keys where a single delivery used one."""
    source = example()
    assert "idempotency_key=ctx.key" in source
    broken = source.replace("idempotency_key=ctx.key", "idempotency_key=str(uuid.uuid4())").replace(
        "from typing import Protocol\n", "import uuid\nfrom typing import Protocol\n", 1
    )
    result = run_example(tmp_path, broken, "-q", "-k", "exactly_once")
    print(result.stdout)
    assert result.returncode == 1
    assert "2 of 9 cases FAILED" in result.stdout
    assert re.search(
        r"crash after handler +2 \(a, b\) +1 +2 with 2 keys +acked +FAIL", result.stdout
    )
    assert re.search(r"zombie +2 \(a, b\) +1 +2 with 2 keys +acked +FAIL", result.stdout)


@pytest.mark.timeout(300)
def test_the_docs_example_fails_when_the_insert_is_not_through_ctx_db(tmp_path: Path) -> None:
    """The charge row written on a connection of its own survives the crash: the retry hits
    its primary key until the message is dead-lettered, where one delivery was acked."""
    source = example()
    assert "await ctx.db.execute(" in source
    helper = (
        "import asyncpg\n"
        "from dedupe.testing import current_run\n\n\n"
        "async def own_connection() -> asyncpg.Connection:\n"
        "    run = current_run()\n"
        "    assert run is not None\n"
        "    return await asyncpg.connect(run.database_url)\n\n\n"
    )
    body = source.replace("await ctx.db.execute(", "await (await own_connection()).execute(")
    broken = body.replace("# -- the code under test", helper + "# -- the code under test", 1)
    result = run_example(tmp_path, broken, "-q", "-k", "exactly_once")
    print(result.stdout)
    assert result.returncode == 1
    assert "2 of 9 cases FAILED" in result.stdout
    assert "ended dead-lettered (max_attempts_exceeded) where a single delivery was acked" in (
        result.stdout
    )
