"""Fixtures shared by every test: real PostgreSQL and RabbitMQ, fresh names per test.

A missing service is a failure, not a skip: `make test` starts them (scripts/services.sh).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from dedupe.app import App
from dedupe.claims.store import ClaimStore
from dedupe.errors import ConfigurationError
from dedupe.pipeline.processor import Processor
from dedupe.testing.databases import create_database, drop_database, drop_templates

ROOT = Path(__file__).resolve().parent.parent
# A subprocess imports this checkout: the core from its root, the transports from consumers/.
CHECKOUT_PATH = os.pathsep.join([str(ROOT), str(ROOT / "consumers")])
ADMIN_URL = os.environ.get(
    "DEDUPE_TEST_DATABASE_URL", "postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe"
)
AMQP_URL = os.environ.get("DEDUPE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
KAFKA_URL = os.environ.get("DEDUPE_TEST_KAFKA_URL", "kafka://127.0.0.1:9092")


# `make test` runs the suite in two phases (README.md, "Development"): the tests that tolerate
# company on two pytest-xdist workers, then these alone, one at a time. A path is a folder, a
# file or one test (its node id without parameters); each says why it cannot share the machine.
SERIAL: dict[str, str] = {
    "tests/chaos/": "kills and freezes worker processes against 2 s leases (CPU- and "
    "timing-sensitive); some rows restart RabbitMQ, Kafka or PostgreSQL for everyone, "
    "terminate backends or run scripts/cluster.sh",
    "tests/acceptance/test_cluster_script.py": "starts and stops scripts/cluster.sh's "
    "clusters (three Kafka brokers, three RabbitMQ nodes, a PostgreSQL pair: most of the "
    "machine) and stops a RabbitMQ node; tests/chaos/test_chaos_failover.py uses them too",
    "tests/acceptance/test_demo.py": "scripts/demo.py's fixed names (the dedupe_demo database, "
    "the payments and receipts channels, .services/demo/) are shared by both brokers' runs; "
    "two workers killed with SIGKILL mid-run",
    "tests/integration/test_rabbitmq_consumer.py::"
    "test_the_consumer_resumes_after_a_broker_restart_and_runs_each_key_once": "rabbitmqctl "
    "stop_app / start_app: every other test's RabbitMQ connections are cut",
    "tests/acceptance/test_worker_process.py::"
    "test_kill_9_mid_run_and_restart_loses_nothing_and_runs_each_key_once": "kill -9 against "
    "a 1 s lease (timing-sensitive)",
    "tests/acceptance/test_worker_process.py::"
    "test_a_message_that_kills_its_worker_is_dead_lettered_after_max_attempts": "kill -9 "
    "against a 0.5 s lease, an exact count of crashes (timing-sensitive)",
    "tests/acceptance/test_kafka_worker_process.py::"
    "test_kill_9_mid_batch_and_restart_loses_nothing_and_runs_each_key_once": "kill -9 "
    "against a 1 s lease (timing-sensitive)",
    "tests/integration/test_http_api_one_transaction.py::"
    "test_a_frozen_process_holds_the_key_until_its_session_is_ended_and_writes_nothing": "SIGSTOP "
    "against a 2 s lease, a 409 expected inside that window (timing-sensitive)",
    "tests/integration/test_http_api_one_transaction.py::"
    "test_the_bound_rolls_a_long_run_back_with_a_503_and_the_retry_runs_under_a_lease": "a "
    "1 s bound on the one-transaction run (timing-sensitive)",
}
PHASES = ("all", "parallel", "serial")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=PHASES,
        default="all",
        help="parallel: only the tests that may share the machine (make test runs them with "
        "-n 2); serial: only those that must run alone (tests/conftest.py's SERIAL); "
        "all (default): both",
    )


def serial_reason(item: pytest.Item) -> str | None:
    """Why `item` must run alone (SERIAL), or None."""
    path = Path(str(item.fspath)).relative_to(ROOT).as_posix()
    test = f"{path}::{item.originalname}" if isinstance(item, pytest.Function) else path
    for prefix, reason in SERIAL.items():
        if prefix in (test, path) or (prefix.endswith("/") and path.startswith(prefix)):
            return reason
    return None


def shared_scope(item: pytest.Item) -> str | None:
    """The module of `item` when it uses a fixture set up once per module, package or class
    (a wheel built, a virtualenv installed): pytest-xdist's loadgroup sends its tests to one
    worker, so that the fixture is not made once on each."""
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if any(d.scope in ("module", "package", "class") for d in defs):
            return Path(str(item.fspath)).relative_to(ROOT).as_posix()
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouping = config.pluginmanager.hasplugin("xdist")
    for item in items:
        parts = Path(str(item.fspath)).parts
        for folder in ("integration", "acceptance", "chaos"):
            if folder in parts:
                item.add_marker(getattr(pytest.mark, folder))
        if serial_reason(item) is not None:
            item.add_marker(pytest.mark.serial)
        elif grouping and (scope := shared_scope(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(scope))
    phase = config.getoption("phase")
    if phase != "all":
        keep = phase == "serial"
        deselected = [item for item in items if bool(item.get_closest_marker("serial")) != keep]
        if deselected:
            items[:] = [item for item in items if bool(item.get_closest_marker("serial")) == keep]
            config.hook.pytest_deselected(items=deselected)


@pytest.fixture(scope="session")
async def _test_databases() -> AsyncIterator[None]:
    """The suite's databases come from dedupe.testing (one migrated template with the payments
    tables, cloned per test); its templates are dropped at the session's end."""
    yield
    await drop_templates()


@pytest.fixture
async def db_url(_test_databases: None) -> AsyncIterator[str]:
    """A fresh, migrated database for one test, with the payments handler's tables."""
    from handlers.payments import setup

    try:
        url = await create_database(ADMIN_URL, setup)
    except ConfigurationError as exc:
        pytest.fail(f"{exc} Run `make services`.")
    yield url
    await drop_database(ADMIN_URL, url)


@pytest.fixture
async def orders_db(db_url: str) -> str:
    """The test's database with the tables of handlers/orders_api.py (the HTTP API's tests)."""
    from handlers.orders_api import setup

    await setup(db_url)
    return db_url


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[ClaimStore]:
    async with ClaimStore.open(db_url, owner="test", max_size=20) as claim_store:
        yield claim_store


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the test's database, for assertions."""
    conn = await asyncpg.connect(db_url)
    yield conn
    await conn.close()


@pytest.fixture
async def channel(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A channel (queue/topic) name no other test uses; its queues and topics go at the end.

    Tests must not leave queues behind: a broker that recovers thousands of stale durable
    queues at boot is slow to start (and stalls when it runs short of file handles).
    """
    name = f"t-{uuid.uuid4().hex[:10]}"
    yield name
    await delete_channel_everywhere(request, name)


async def delete_channel_everywhere(request: pytest.FixtureRequest, *names: str) -> None:
    """Delete these channels' RabbitMQ queues, and their Kafka topics too when the test is a
    Kafka one (by its id or its use of the kafka_url fixture)."""
    import dedupe_kafka as kafka_clients
    import dedupe_rabbitmq as rabbitmq

    deletions = [rabbitmq.delete_channels(AMQP_URL, list(names))]
    if "kafka" in request.node.nodeid.lower() or "kafka_url" in request.fixturenames:
        deletions.append(kafka_clients.delete_channels(KAFKA_URL, list(names)))
    for deletion in deletions:
        try:
            await asyncio.wait_for(deletion, timeout=15)
        except Exception as exc:  # a broker stopped by the test itself: nothing to tidy
            warnings.warn(f"could not delete the test channels {names}: {exc!r}", stacklevel=1)


@pytest.fixture
def amqp_url() -> str:
    return AMQP_URL


@pytest.fixture
def kafka_url() -> str:
    return KAFKA_URL


@pytest.fixture(params=["rabbitmq", "kafka"])
def broker(request: pytest.FixtureRequest) -> object:
    """The same test body on each broker: publish, make workers, read dead letters and backlog."""
    from tests.integration.brokers import KafkaBroker, RabbitBroker

    if request.param == "rabbitmq":
        return RabbitBroker(AMQP_URL)
    return KafkaBroker(KAFKA_URL)


@contextlib.asynccontextmanager
async def running(
    app: App, store: ClaimStore, transport: object, **options: object
) -> AsyncIterator[Processor]:
    """Run `app` on `transport` in this event loop until the block ends (graceful stop)."""
    from dedupe.transport import Transport

    assert isinstance(transport, Transport)
    stop = asyncio.Event()
    async with Processor(app, store, **options) as processor:  # type: ignore[arg-type]
        serving = asyncio.create_task(transport.serve(list(app.channels), processor.process, stop))
        try:
            yield processor
        finally:
            stop.set()
            await processor.drain(timeout_s=10)
            await serving
            await transport.close()


async def eventually(predicate, *, timeout_s: float = 20.0, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll an async predicate until it is truthy; fail with its last value after timeout_s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    value = None
    while asyncio.get_running_loop().time() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval_s)
    pytest.fail(f"condition not met within {timeout_s}s (last value: {value!r})")
