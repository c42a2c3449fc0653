"""A typo in an option is an error naming the closest valid option, never a silent default:
dedupe.Worker(...), Settings(...), App.handler(...) and the Kafka URL's options."""

from __future__ import annotations

import pytest

from dedupe import App, Worker
from dedupe.errors import ConfigurationError, InvalidOption
from dedupe.settings import Settings
from dedupe_kafka.options import KafkaOptions


def test_a_worker_refuses_an_unknown_option_and_names_the_closest() -> None:
    app = App("typos")
    with pytest.raises(InvalidOption) as refused:
        Worker(app, concurency=4)
    assert str(refused.value) == (
        "Worker: unknown option 'concurency' — did you mean 'concurrency'?"
    )
    with pytest.raises(InvalidOption, match="did you mean 'database_url'"):
        Worker(app, settings=Settings(), databse_url="postgresql://x/y")
    with pytest.raises(InvalidOption, match="did you mean 'observers'"):
        Worker(app, observer=[])  # one of Worker's own arguments, misspelt
    with pytest.raises(InvalidOption) as far:
        Worker(app, xyzzy=1)
    assert "unknown option 'xyzzy'; the options are " in str(far.value)
    assert "concurrency" in str(far.value)
    # The right names still work.
    assert Worker(app, concurrency=4).settings.concurrency == 4


def test_a_worker_refuses_a_bad_value_with_the_one_root_error() -> None:
    """A value the settings refuse is a DedupeError (InvalidOption, a ValueError too) that
    names the field, not pydantic's own error."""
    from dedupe import DedupeError

    app = App("values")
    with pytest.raises(DedupeError, match="concurrency: Input should be greater than or equal"):
        Worker(app, concurrency=0)
    with pytest.raises(InvalidOption, match=r"broker_url: .*no transport is installed for nope://"):
        Worker(app, broker_url="nope://x")
    with pytest.raises(ValueError, match="concurrency"):
        Worker(app, settings=Settings(), concurrency=-1)


def test_settings_refuse_an_unknown_keyword_but_not_an_unknown_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keyword arguments are code: a typo fails. DEDUPE_* variables are left alone: the
    commands' own options read DEDUPE_<COMMAND>_<OPTION>, and other tools may share the
    prefix."""
    with pytest.raises(InvalidOption, match="unknown option 'concurency' — did you mean"):
        Settings(concurency=4)
    monkeypatch.setenv("DEDUPE_GC_BATCH_SIZE", "10")
    monkeypatch.setenv("DEDUPE_CONCURRENCY", "7")
    assert Settings().concurrency == 7


def test_app_handler_refuses_an_unknown_option_and_names_the_closest() -> None:
    app = App("typos")
    with pytest.raises(InvalidOption) as refused:
        app.handler("orders", max_attemps=3)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "app.handler('orders'): unknown option 'max_attemps' — did you mean 'max_attempts'?"
    )
    with pytest.raises(InvalidOption, match="did you mean 'fingerprint_exclude'"):
        app.handler("orders", fingerprint_excludes=("a",))  # type: ignore[arg-type]
    assert not app.handlers


def test_an_unknown_kafka_url_option_names_the_closest() -> None:
    with pytest.raises(ConfigurationError) as refused:
        KafkaOptions.from_url("kafka://127.0.0.1:9092?group_idd=orders")
    assert "unknown Kafka option 'group_idd' in the broker URL — did you mean 'group_id'?" in str(
        refused.value
    )


def test_the_command_warns_of_a_dedupe_variable_one_slip_from_a_known_one() -> None:
    """The environment is shared with other tools: an unknown DEDUPE_* variable is ignored,
    with a warning only when it is a near miss of one the commands read."""
    from dedupe.cli.options import misspelt_variables
    from dedupe.cli.parser import build_parser

    environ = {
        "DEDUPE_CONCURENCY": "4",  # a typo of a setting
        "DEDUPE_GC_BATCH_SIZ": "5",  # a typo of a command's option
        "DEDUPE_GC_BATCH_SIZE": "5",  # a command's option: known
        "DEDUPE_TEST_DATABASE_URL": "x",  # another tool's: far enough
        "DEDUPE_SOMETHING_ELSE": "1",
    }
    assert misspelt_variables(build_parser(), environ) == [
        "the environment variable DEDUPE_CONCURENCY is not one dedupe-worker reads (ignored) "
        "— did you mean DEDUPE_CONCURRENCY?",
        "the environment variable DEDUPE_GC_BATCH_SIZ is not one dedupe-worker reads (ignored) "
        "— did you mean DEDUPE_GC_BATCH_SIZE?",
    ]
