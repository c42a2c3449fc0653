"""docs/configuration.md stays in step with the settings, the command line and the code."""

from __future__ import annotations

import dataclasses
import re

from dedupe.cli.reference import MEANING, OTHER_VARIABLES, reference, settings_read_by
from dedupe.settings import Settings
from dedupe_kafka.options import MEANING as KAFKA_MEANING
from dedupe_kafka.options import RUN_DEFAULT as KAFKA_RUN_DEFAULT
from dedupe_kafka.options import KafkaOptions
from dedupe_kafka.transport import KafkaTransport
from tests.conftest import ROOT

DOCS = ROOT / "docs" / "configuration.md"


def test_every_setting_has_a_meaning() -> None:
    assert set(MEANING) == set(Settings.model_fields)


def test_the_configuration_reference_is_the_generated_one() -> None:
    """Regenerate with: python -m dedupe.cli.reference (between the reference markers)."""
    text = DOCS.read_text()
    documented = text.split("<!-- reference:begin -->\n", 1)[1].split("<!-- reference:end -->")[0]
    assert documented == reference()


def test_every_environment_variable_is_documented() -> None:
    text = DOCS.read_text()
    for name in Settings.model_fields:
        assert f"`DEDUPE_{name.upper()}`" in text


def test_every_kafka_url_option_has_a_meaning() -> None:
    fields = {f.name for f in dataclasses.fields(KafkaOptions)} - {"bootstrap_servers"}
    assert set(KAFKA_MEANING) == fields
    assert set(KAFKA_RUN_DEFAULT) <= fields


def test_the_kafka_defaults_documented_for_run_are_the_transports() -> None:
    """run passes its settings and the app's name: group, client id, batch and revoke time."""
    settings = Settings(worker_name="w-1", concurrency=3, shutdown_timeout_s=25)
    options = KafkaTransport("kafka://h:9092", settings=settings, app_name="shop").options
    assert (options.group_id, options.client_id) == ("dedupe-shop", "w-1")
    assert (options.batch_max, options.revoke_timeout_s) == (24, 10.0)  # 8 x concurrency
    quick = Settings(prefetch=9, shutdown_timeout_s=4)
    options = KafkaTransport("kafka://h:9092", settings=quick, app_name="shop").options
    assert (options.batch_max, options.revoke_timeout_s) == (9, 4.0)
    untouched = set(KAFKA_MEANING) - set(KAFKA_RUN_DEFAULT)
    plain = KafkaOptions(bootstrap_servers="h:9092")
    assert all(getattr(options, name) == getattr(plain, name) for name in untouched)


def test_read_by_names_every_command_whose_code_reads_a_setting() -> None:
    """The audit's finding: receive reads four settings the table listed as run's alone."""
    read_by = settings_read_by()
    for name in ("shutdown_timeout_s", "worker_name", "connect_timeout_s"):
        assert {"run", "receive"} <= read_by[name], name
    assert {"receive", "status"} <= read_by["status_token"]
    assert "run" not in read_by["status_token"]
    assert read_by["concurrency"] == read_by["prefetch"] == {"run"}  # prefetch: via a property
    logging = {"log_level", "log_format", "event_loop"}
    assert {name for name, used in read_by.items() if "migrate" in used} == {
        "database_url",
        *logging,
    }


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    """os.environ / os.getenv with a literal name in dedupe/ or consumers/: in the docs."""
    pattern = re.compile(r"""(?:environ\.get|getenv|environ)\s*[\(\[]\s*["']([A-Z0-9_]+)["']""")
    read = {
        name
        for folder in ("dedupe", "consumers")
        for path in (ROOT / folder).rglob("*.py")
        for name in pattern.findall(path.read_text())
    }
    assert "PGSSLMODE" in read  # the scan works
    documented = {v for names in OTHER_VARIABLES for v in names.split(", ")}
    documented |= {f"DEDUPE_{name.upper()}" for name in Settings.model_fields}
    assert read - documented == set()
    text = DOCS.read_text()
    assert all(f"`{name}`" in text for name in read)
