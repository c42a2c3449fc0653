"""The schema gate from the command line: `dedupe-worker run`, `receive` and the operator
commands refuse a database at another schema version, and `migrate --check` says whether
migrations are pending, with an exit status a deploy pipeline can act on."""

from __future__ import annotations

import asyncpg
import pytest

import dedupe_rabbitmq as rabbitmq
from tests.acceptance.conftest import run_cli
from tests.conftest import CHECKOUT_PATH
from tests.integration.brokers import RabbitBroker
from tests.integration.test_receiver import GH_SECRET, free_port
from tests.integration.test_schema_gate import (
    LAST,
    SCHEMAS,
    assert_says,
    never_migrated,
    newer,
    older,
)

LAST_NAME = f"{LAST[0]:04d}_{LAST[1]}"


async def applied(url: str) -> list[int] | None:
    """The versions dedupe_migrations records; None when it does not exist."""
    conn = await asyncpg.connect(url)
    try:
        if not await conn.fetchval("SELECT to_regclass('dedupe_migrations') IS NOT NULL"):
            return None
        return [r[0] for r in await conn.fetch("SELECT version FROM dedupe_migrations")]
    finally:
        await conn.close()


@pytest.mark.parametrize("schema", list(SCHEMAS))
async def test_run_refuses_another_schema_with_the_command_and_takes_no_message(
    schema: str, db_url: str, amqp_url: str, channel: str
) -> None:
    """`dedupe-worker run` exits 1 at once, says which version it found and which it needs and
    to run `dedupe-worker migrate`; the message waiting on its queue stays there."""
    url = await SCHEMAS[schema](db_url)
    await rabbitmq.publish(amqp_url, channel, [(b'{"n": 1}', {}, "k1")])
    env = {
        "DEDUPE_DATABASE_URL": url,
        "DEDUPE_BROKER_URL": amqp_url,
        "CRASHY_CHANNEL": channel,
        "PYTHONPATH": CHECKOUT_PATH,
    }
    result = run_cli("run", "tests.apps.crashy:app", env=env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert_says(result.stderr, schema)
    assert await RabbitBroker(amqp_url).backlog(channel) == 1


@pytest.mark.parametrize("schema", ["older", "never migrated"])
async def test_receive_refuses_another_schema_before_it_serves(
    schema: str, db_url: str, amqp_url: str
) -> None:
    url = await SCHEMAS[schema](db_url)
    env = {
        "DEDUPE_DATABASE_URL": url,
        "DEDUPE_BROKER_URL": amqp_url,
        "GITHUB_WEBHOOK_SECRET": GH_SECRET,
        "PYTHONPATH": CHECKOUT_PATH,
    }
    result = run_cli(
        "receive", "tests.integration.test_receiver:cli_app", "--port", str(free_port()), env=env
    )
    assert result.returncode == 1, result.stderr
    assert_says(result.stderr, schema)


async def test_operator_commands_refuse_another_schema(db_url: str) -> None:
    url = await older(db_url)
    env = {"DEDUPE_DATABASE_URL": url}
    for command in (["claims", "list"], ["gc"], ["conflicts", "list"], ["status"]):
        result = run_cli(*command, env=env)
        assert result.returncode == 1, (command, result.stderr)
        assert_says(result.stderr, "older")


async def test_migrate_check_exits_0_up_to_date_1_pending_and_changes_nothing(
    db_url: str,
) -> None:
    """0 and one line on a migrated database; 1 and the pending names on an older one,
    which it leaves as it was; `migrate` then brings it up to date and --check says 0."""
    env = {"DEDUPE_DATABASE_URL": db_url}
    fresh = run_cli("migrate", "--check", env=env)
    assert fresh.returncode == 0, fresh.stderr
    assert f"up to date: schema version {LAST[0]}" in fresh.stdout

    await older(db_url)
    pending = run_cli("migrate", "--check", env=env)
    assert pending.returncode == 1, pending.stderr
    assert_says(pending.stdout, "older")
    assert LAST[0] not in (await applied(db_url) or [])  # --check applied nothing

    assert LAST_NAME in run_cli("migrate", env=env).stdout
    again = run_cli("migrate", "--check", env=env)
    assert again.returncode == 0, again.stdout + again.stderr


async def test_migrate_check_names_a_database_never_migrated_and_creates_nothing(
    db_url: str,
) -> None:
    url = await never_migrated(db_url)
    result = run_cli("migrate", "--check", env={"DEDUPE_DATABASE_URL": url})
    assert result.returncode == 1, result.stderr
    assert_says(result.stdout, "never migrated")
    assert await applied(url) is None


async def test_migrate_and_its_check_exit_3_on_a_database_newer_than_this_code(
    db_url: str,
) -> None:
    """A distinct status when a newer dedupe-worker migrated the database: `migrate` applies
    nothing there and says so, instead of "up to date"."""
    url = await newer(db_url)
    env = {"DEDUPE_DATABASE_URL": url}
    checked = run_cli("migrate", "--check", env=env)
    assert checked.returncode == 3, checked.stdout + checked.stderr
    assert_says(checked.stdout, "newer")
    migrated = run_cli("migrate", env=env)
    assert migrated.returncode == 3, migrated.stdout + migrated.stderr
    assert "up to date" not in migrated.stdout
    assert_says(migrated.stderr, "newer")


async def test_a_misspelt_dedupe_variable_is_named_in_the_commands_log(db_url: str) -> None:
    result = run_cli(
        "migrate", "--check", env={"DEDUPE_DATABASE_URL": db_url, "DEDUPE_CONCURENCY": "4"}
    )
    assert result.returncode == 0, result.stderr
    assert "DEDUPE_CONCURENCY" in result.stderr
    assert "did you mean DEDUPE_CONCURRENCY?" in result.stderr
