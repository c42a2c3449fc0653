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
