"""Chaos with a leader killed under the workers (issue 27 item 3), on the replicated brokers of
scripts/cluster.sh: three Kafka KRaft brokers (RF 3, min.insync.replicas=2) and a three-node
RabbitMQ cluster with quorum queues. The workers' URL lists the three nodes; their claims
database is the usual single node. At each milestone the node leading the channel (the broker
that leads most of the topic's partitions; the node that leads the quorum queue) is killed with
kill -9, and once another node leads, it is started again, back in the cluster before the next
kill (so a majority always remains). The invariants of tests/chaos/harness.py hold as they
stand: nothing lost, no effect twice, drained."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dedupe_kafka as kafka
import dedupe_rabbitmq as rabbitmq
from tests.chaos import faults
from tests.chaos.brokers import ChaosKafka, ChaosRabbit
from tests.chaos.conftest import SIZE, run_scenario
from tests.integration.brokers import Broker

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"
AMQP = "amqp://guest:guest@127.0.0.1:5681,127.0.0.1:5682,127.0.0.1:5683/?queue_type=quorum"
RABBIT_NODES = [f"dedupe-c{i}@localhost" for i in (1, 2, 3)]
KAFKA = "kafka://127.0.0.1:19092,127.0.0.1:19192,127.0.0.1:19292"

# Each kill costs a node's start-up (a Kafka broker also catches up before the next one): 2 in
# make test; in the large run (make chaos) CHAOS_LEADER_FAULTS, 50 like the other repeated
# faults (about 18 min on RabbitMQ, 30 on Kafka here), else CHAOS_RESTART_FAULTS.
KILLS = int(os.environ.get("CHAOS_LEADER_FAULTS") or os.environ.get("CHAOS_RESTART_FAULTS", "2"))

CLUSTER_BROKERS: dict[str, Callable[[], Broker]] = {
    "rabbitmq": lambda: ChaosRabbit(AMQP, nodes=RABBIT_NODES),
    "kafka": lambda: ChaosKafka(KAFKA),
}
LEADER = {"rabbitmq": "the RabbitMQ node leading the quorum queue", "kafka": "the leading broker"}


def _script(*args: str, timeout: float = 600) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def brokers_down_after() -> Iterator[None]:
    """Each test starts its cluster (`up` restarts a node a kill left down); the module stops
    both after it: the other tests keep the machine's two cores."""
    yield
    _script("down", "rabbitmq", "kafka", timeout=300)


async def _tidy(broker: str, channel: str) -> None:
    with contextlib.suppress(Exception):
        if broker == "rabbitmq":
            await rabbitmq.delete_channels(AMQP, [channel])
        else:
            await kafka.delete_channels(KAFKA, [channel])


# The large run (make chaos) has no timeout; the small one, room for the nodes' start-ups.
@pytest.mark.timeout(0 if SIZE > 10_000 else 600)
@pytest.mark.parametrize("broker", list(CLUSTER_BROKERS))
async def test_killing_the_leader_loses_nothing_and_does_nothing_twice(
    broker: str, db_url: str, channel: str, tmp_path: Path, brokers_down_after: None
) -> None:
    _script("up", broker)
    try:
        report = await run_scenario(
            f"kill -9 {LEADER[broker]} (3-node cluster)",
            CLUSTER_BROKERS[broker](),
            faults.kill_cluster_leader(broker, channel),
            db_url=db_url,
            channel=channel,
            logs=tmp_path,
            faults=KILLS,
        )
    finally:
        await _tidy(broker, channel)
    assert not report.problems, report.problems
