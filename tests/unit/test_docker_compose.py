"""docker-compose.yml describes the same three services as scripts/services.sh.

Docker (with compose) is not on every machine, so the file is checked as YAML here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
POM = ROOT / "scripts" / "kafka" / "pom.xml"

# service -> (image name without tag, the container port published on the host)
EXPECTED = {
    "postgres": ("postgres", 5432),
    "rabbitmq": ("rabbitmq", 5672),
    "kafka": ("apache/kafka", 9092),
}


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict), "docker-compose.yml must be a mapping"
    found = data.get("services")
    assert isinstance(found, dict), "docker-compose.yml has no services mapping"
    return found


def published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) for each entry of a service's ports list."""
    result = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):  # long syntax
            ip = str(entry.get("host_ip", ""))
            result.append((ip, int(entry["published"]), int(entry["target"])))
            continue
        parts = str(entry).split(":")
        if len(parts) == 3:
            ip, host, container = parts
        elif len(parts) == 2:
            ip, (host, container) = "", parts
        else:
            ip, host, container = "", parts[0], parts[0]
        result.append((ip, int(host), int(container.split("/")[0])))
    return result


def env(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as a dict, whichever of the two compose syntaxes it uses."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        return dict(item.split("=", 1) for item in raw)
    return {key: str(value) for key, value in raw.items()}


def test_compose_file_is_valid_yaml_with_the_three_services(services: dict[str, Any]) -> None:
    """The file parses and names postgres, rabbitmq and kafka."""
    assert set(EXPECTED) <= set(services)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_service_uses_its_expected_image(services: dict[str, Any], name: str) -> None:
    """Each service runs the image its name promises, with an explicit tag."""
    image = services[name].get("image", "")
    repository, _, tag = image.partition(":")
    assert repository == EXPECTED[name][0]
    assert tag, f"{name}: pin an image tag"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_service_publishes_its_port_on_localhost_only(
    services: dict[str, Any], name: str
) -> None:
    """The standard port is published to the same port on 127.0.0.1, never on all interfaces."""
    port = EXPECTED[name][1]
    entries = published(services[name])
    assert ("127.0.0.1", port, port) in entries
    assert all(ip == "127.0.0.1" for ip, _, _ in entries), entries


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_service_has_a_healthcheck(services: dict[str, Any], name: str) -> None:
    """Every service declares a health check command with bounded timing."""
    check = services[name].get("healthcheck")
    assert isinstance(check, dict), f"{name}: no healthcheck"
    assert check.get("test"), f"{name}: healthcheck has no test"
    assert not check.get("disable", False)
    for key in ("interval", "timeout", "retries"):
        assert key in check, f"{name}: healthcheck lacks {key}"


def test_postgres_credentials_match_the_local_dsn(services: dict[str, Any]) -> None:
    """PostgreSQL's user, password and database are all dedupe, as in the local DSN."""
    values = env(services["postgres"])
    assert values["POSTGRES_USER"] == "dedupe"
    assert values["POSTGRES_PASSWORD"] == "dedupe"
    assert values["POSTGRES_DB"] == "dedupe"


def test_kafka_runs_kraft_single_node_advertised_on_localhost(services: dict[str, Any]) -> None:
    """Kafka is one KRaft broker+controller that host clients reach as 127.0.0.1:9092."""
    values = env(services["kafka"])
    assert set(values["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "PLAINTEXT://127.0.0.1:9092" in values["KAFKA_ADVERTISED_LISTENERS"].split(",")
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert values[key] == "1", key


def test_kafka_image_matches_the_version_services_sh_runs(services: dict[str, Any]) -> None:
    """The apache/kafka tag equals kafka.version in scripts/kafka/pom.xml."""
    match = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    assert match, "scripts/kafka/pom.xml has no kafka.version"
    assert services["kafka"]["image"] == f"apache/kafka:{match.group(1)}"


# The cluster profile: what scripts/cluster.sh runs, on the same host ports.
CLUSTER = {
    "pg-primary": 5442,
    "pg-standby": 5443,
    "rabbit-c1": 5681,
    "rabbit-c2": 5682,
    "rabbit-c3": 5683,
    "kafka-c1": 19092,
    "kafka-c2": 19192,
    "kafka-c3": 19292,
}


@pytest.mark.parametrize("name", sorted(CLUSTER))
def test_the_cluster_profile_matches_cluster_sh(services: dict[str, Any], name: str) -> None:
    """Each cluster node is in the `cluster` profile only (a plain `up` starts the three single
    nodes), publishes cluster.sh's port on 127.0.0.1, and has a health check."""
    service = services[name]
    assert service.get("profiles") == ["cluster"]
    ports = published(service)
    assert [(ip, host) for ip, host, _ in ports] == [("127.0.0.1", CLUSTER[name])]
    assert service.get("healthcheck", {}).get("test")
    script = (ROOT / "scripts" / "cluster.sh").read_text()
    assert str(CLUSTER[name]) in script


def test_the_cluster_kafka_is_three_voters_with_rf_3_and_min_isr_2(
    services: dict[str, Any],
) -> None:
    ids = set()
    for name in ("kafka-c1", "kafka-c2", "kafka-c3"):
        found = env(services[name])
        ids.add(found["KAFKA_NODE_ID"])
        assert found["KAFKA_CONTROLLER_QUORUM_VOTERS"].count("@") == 3
        assert found["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3"
        assert found["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert found["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        port = str(CLUSTER[name])
        assert f"127.0.0.1:{port}" in found["KAFKA_ADVERTISED_LISTENERS"]
    assert ids == {"1", "2", "3"}


def test_the_cluster_standby_streams_synchronously_from_the_primary(
    services: dict[str, Any],
) -> None:
    primary = " ".join(services["pg-primary"]["command"])
    standby = " ".join(services["pg-standby"]["command"])
    assert "synchronous_standby_names=dedupe_standby" in primary
    assert "host replication dedupe" in primary
    assert "application_name=dedupe_standby" in standby and "-R" in standby
