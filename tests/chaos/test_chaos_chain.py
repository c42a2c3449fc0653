"""Chaos under a two-stage chain, on RabbitMQ and on Kafka: stage A publishes through the outbox
to stage B; kills at each failpoint, at random, a freeze past the lease and a broker restart.
Every order has exactly one effect at each stage, nothing is lost, and the relay drains within
lease + 30 s (invariants in tests/chaos/chain.py). And a durable step survives a kill -9."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from tests.apps import chain
from tests.apps.chaos import SCHEMA
from tests.chaos import faults
from tests.chaos.chain import run_chain_scenario
from tests.chaos.conftest import LEASE_S
from tests.chaos.harness import Workers
from tests.chaos.test_chaos_workers import BROKERS, RESTART_FAULTS, restarts_allowed
from tests.conftest import delete_channel_everywhere

CHAIN_FAULTS = {
    "kill -9 after the claim": faults.kill_at_failpoint("claimed"),
    "kill -9 after the handler, before completion": faults.kill_at_failpoint("handled"),
    "kill -9 after completion, before the ack or offset commit": faults.kill_at_failpoint(
        "completed"
    ),
    "kill -9 at random moments": faults.kill_at_random,
    "SIGSTOP past the lease, then SIGCONT": faults.freeze_past_the_lease,
}

# One restart scenario per broker (each restarts a shared service; DEDUPE_CHAOS_RESTARTS=0
# skips them).
CHAIN_RESTARTS = {
    "rabbitmq": ("RabbitMQ restart", faults.restart_rabbitmq),
    "kafka": ("Kafka broker restart", faults.restart_kafka),
}


@pytest.fixture
async def next_channel(request: pytest.FixtureRequest, channel: str) -> AsyncIterator[str]:
    """Stage B's channel, of the test's own, deleted at the end."""
    name = f"{channel}-b"
    yield name
    await delete_channel_everywhere(request, name)


@pytest.mark.parametrize("broker", list(BROKERS))
@pytest.mark.parametrize("name", list(CHAIN_FAULTS))
async def test_a_chain_under_worker_faults_has_one_effect_per_stage_and_drains(
    broker: str, name: str, db_url: str, channel: str, next_channel: str, tmp_path: Path
) -> None:
    """Under each worker fault every order has one effect at A and one at B, or its dead
    letter at A; the outbox is relayed in full within the drain window."""
    report = await run_chain_scenario(
        f"chain: {name}",
        BROKERS[broker](),
        CHAIN_FAULTS[name],
        db_url=db_url,
        channel=channel,
        next_channel=next_channel,
        logs=tmp_path,
    )
    assert not report.problems, report.problems


@restarts_allowed
@pytest.mark.parametrize("broker", list(CHAIN_RESTARTS))
async def test_a_chain_under_broker_restarts_has_one_effect_per_stage_and_drains(
    broker: str, db_url: str, channel: str, next_channel: str, tmp_path: Path
) -> None:
    """The broker restarts under the workers and their relays: refused publishes are tried
    again, nothing is lost, nothing runs twice."""
    name, fault = CHAIN_RESTARTS[broker]
    report = await run_chain_scenario(
        f"chain: {name}",
        BROKERS[broker](),
        fault,
        db_url=db_url,
        channel=channel,
        next_channel=next_channel,
        logs=tmp_path,
        faults=RESTART_FAULTS,
    )
    assert not report.problems, report.problems


async def _until(what: str, predicate: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s:.0f}s")


@pytest.mark.parametrize("broker", list(BROKERS))
async def test_a_step_recorded_before_a_kill_9_is_not_called_again_by_the_next_owner(
    broker: str, db_url: str, channel: str, next_channel: str, tmp_path: Path
) -> None:
    """A real worker SIGKILLs itself after stage A's handler returned (its step recorded, its
    outcome not committed); the next worker takes the key over once the lease lapses and
    completes it from the step's record: the external service was called once."""
    db = await asyncpg.connect(db_url)
    try:
        await db.execute(SCHEMA + chain.SCHEMA)
        chaos_broker = BROKERS[broker]()
        fuse = tmp_path / "failpoint.fuse"
        fuse.touch()
        workers = Workers(
            {
                "DEDUPE_DATABASE_URL": db_url,
                "DEDUPE_BROKER_URL": chaos_broker.worker_url(channel),
                "DEDUPE_GC_INTERVAL_S": "0",
                "CHAOS_CHANNEL": channel,
                "CHAIN_NEXT": next_channel,
                "CHAOS_LEASE_S": str(LEASE_S),
                "CHAOS_FAILPOINT": "handled",
                "CHAOS_FUSE": str(fuse),
            },
            tmp_path,
            app="tests.apps.chain:app",
        )
        body = json.dumps({"id": "order-1", "v": 7}).encode()
        await chaos_broker.publish(channel, [(body, {"X-Tenant": "t-a"}, "order-1")])
        try:
            first = workers.start()
            await asyncio.to_thread(first.wait, 60)
            assert first.returncode == -signal.SIGKILL
            assert not fuse.exists()  # it took the fuse: killed at the failpoint
            step = await db.fetchval("SELECT result::text FROM dedupe_steps WHERE key = 'order-1'")
            assert step == "null"  # recorded when the call returned
            assert await db.fetchval("SELECT count(*) FROM chaos_effects") == 0
            assert await db.fetchval("SELECT count(*) FROM chaos_external") == 1

            workers.start()  # the next owner

            async def delivered() -> bool:
                return bool(await db.fetchval("SELECT count(*) FROM chain_effects"))

            await _until("stage B did not run", delivered, timeout_s=90)
        finally:
            workers.stop()
        status = await db.fetchval(
            "SELECT status FROM dedupe_claims WHERE scope = $1 AND key = 'order-1'",
            f"{chain.SCOPE}/t-a",
        )
        assert status == "completed"
        assert await db.fetchval("SELECT count(*) FROM chaos_external") == 1  # not called again
        assert await db.fetchval("SELECT count(*) FROM chaos_effects") == 1
        assert await db.fetchval("SELECT count(*) FROM chain_effects") == 1
    finally:
        await db.close()
