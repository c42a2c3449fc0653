"""Every option of every command reads an environment variable, named in its --help."""

from __future__ import annotations

import argparse

import pytest
from pydantic_settings import BaseSettings

from dedupe.cli import build_parser, main
from dedupe.cli.options import (
    FromEnvironment,
    UsageError,
    commands,
    positive_float,
    positive_int,
    read_environment,
    variable_of,
)
from dedupe.settings import Settings
from tests.conftest import ROOT

# (command, option) -> why it reads no variable. Everything else must read one.
EXEMPT = {
    ("claims release", "--yes"): "a destructive command is confirmed each time, never by "
    "a variable left in the environment",
    ("claims purge", "--yes"): "the same: confirmation is per invocation",
    ("dlq replay", "--yes"): "the same: confirmation is per invocation",
    ("claims purge", "--older-than-s"): "what a purge deletes is typed each time (required)",
    ("conflicts settle", "--yes"): "the same: confirmation is per invocation",
    ("conflicts settle", "--discard"): "how a conflict is settled is typed each time",
    ("conflicts settle", "--run-as"): "the same: the new key is typed each time",
    ("conflicts settle", "--id"): "the same: which conflict is typed each time",
    ("conflicts settle", "scope"): "positional: the claim the command acts on",
    ("conflicts settle", "key"): "positional: the claim the command acts on",
    ("run", "app"): "positional: the app the command runs",
    ("receive", "app"): "positional: the app the command serves",
    ("claims show", "scope"): "positional: the claim the command acts on",
    ("claims show", "key"): "positional: the claim the command acts on",
    ("claims release", "scope"): "positional: the claim the command acts on",
    ("claims release", "key"): "positional: the claim the command acts on",
    ("dlq list", "channel"): "positional: the channel the command acts on",
    ("dlq replay", "channel"): "positional: the channel the command acts on",
}
# --help of every command is exempt too: it prints the help and exits.


def options() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    """Every option and positional argument of every command, but --help and subcommands."""
    return [
        (command, parser, action)
        for command, parser in commands(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    ]


def name_of(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


def command_options() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    return [o for o in options() if isinstance(o[2].default, FromEnvironment)]


def argv_for(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """The shortest command line the parser accepts: its positionals and required options."""
    argv = command.split()
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            argv.append("x:y")
        elif action.required:
            argv += [action.option_strings[0], "1"]
    return argv


def sample(action: argparse.Action) -> tuple[str, object]:
    """A value for the action's variable, and what the option should then hold."""
    if action.nargs == 0:
        return "yes", True
    if action.choices:
        choice = list(action.choices)[-1]
        return str(choice), choice
    if action.type in (int, positive_int):
        return "7", 7
    if action.type in (float, positive_float):
        return "2.5", 2.5
    return "from-env", "from-env"


def parse(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    read_environment(parser, args, environ)
    return args


def test_every_option_reads_a_variable_that_its_help_names_or_is_an_explained_exemption() -> None:
    missing, stale = [], []
    for command, _, action in options():
        variable = variable_of(action)
        if (command, name_of(action)) in EXEMPT:
            if variable is not None:
                stale.append(f"{command} {name_of(action)} reads {variable}: not exempt")
        elif variable is None:
            missing.append(f"{command} {name_of(action)} reads no environment variable")
        elif variable not in (action.help or ""):
            missing.append(f"{command} {name_of(action)}: its help does not name {variable}")
    assert not missing and not stale, "\n".join(missing + stale)


def test_every_exemption_is_an_option_that_exists() -> None:
    present = {(command, name_of(action)) for command, _, action in options()}
    assert set(EXEMPT) <= present


@pytest.mark.parametrize(
    ("command", "parser", "action"),
    command_options(),
    ids=[f"{c} {name_of(a)}" for c, _, a in command_options()],
)
def test_the_variable_of_a_command_option_sets_it_and_the_command_line_wins(
    command: str, parser: argparse.ArgumentParser, action: argparse.Action
) -> None:
    marker = action.default
    assert isinstance(marker, FromEnvironment)
    raw, expected = sample(action)
    argv = argv_for(command, parser)
    assert getattr(parse(argv, {}), action.dest) == marker.fallback
    assert getattr(parse(argv, {marker.variable: raw}), action.dest) == expected
    if action.nargs != 0:
        given = [*argv, action.option_strings[0], raw]
        other = "9" if action.type in (int, float, positive_int, positive_float) else raw
        assert getattr(parse(given, {marker.variable: other}), action.dest) == expected


def test_an_option_of_one_command_does_not_take_another_commands_variable() -> None:
    """`limit` is an option of four commands: each reads its own variable and default."""
    environ = {"DEDUPE_CLAIMS_LIST_LIMIT": "3", "DEDUPE_DLQ_LIST_LIMIT": "4"}
    assert parse(["status"], environ).limit == 20
    assert parse(["claims", "list"], environ).limit == 3
    assert parse(["dlq", "list", "payments"], environ).limit == 4
    assert parse(["dlq", "replay", "payments"], environ).limit == 100


def test_no_two_options_share_a_variable_and_none_shadows_a_setting() -> None:
    owners: dict[str, set[str]] = {}
    for command, _, action in command_options():
        assert isinstance(action.default, FromEnvironment)
        owners.setdefault(action.default.variable, set()).add(f"{command} {name_of(action)}")
    assert {v: o for v, o in owners.items() if len(o) > 1} == {}
    taken = {f"DEDUPE_{name.upper()}" for name in Settings.model_fields}
    for model in BaseSettings.__subclasses__():
        if model.__module__.startswith("dedupe.") and model is not Settings:
            prefix = str(model.model_config.get("env_prefix", "")).upper()
            taken |= {f"{prefix}{name.upper()}" for name in model.model_fields}
    assert set(owners) & taken == set()


@pytest.mark.parametrize(
    ("variable", "value", "argv", "says"),
    [
        ("DEDUPE_GC_BATCH_SIZE", "many", ["gc"], "expected a whole number"),
        ("DEDUPE_STATUS_STUCK_AFTER_S", "1m", ["status"], "expected a number"),
        ("DEDUPE_CLAIMS_LIST_STATUS", "done", ["claims", "list"], "expected one of in_progress"),
        ("DEDUPE_STATUS_JSON", "maybe", ["status"], "expected true or false"),
    ],
)
def test_a_bad_variable_is_refused_with_a_message_that_names_it(
    variable: str, value: str, argv: list[str], says: str
) -> None:
    with pytest.raises(UsageError, match=f"{variable}='{value}': {says}"):
        parse(argv, {variable: value})


def test_a_bad_variable_stops_the_command_with_exit_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEDUPE_GC_MAX_BATCHES", "all")
    with pytest.raises(SystemExit) as stopped:
        main(["gc"])
    assert stopped.value.code == 2
    assert "DEDUPE_GC_MAX_BATCHES='all'" in capsys.readouterr().err


def test_an_empty_or_false_variable_leaves_a_flag_off() -> None:
    assert parse(["status"], {"DEDUPE_STATUS_JSON": ""}).json is False
    assert parse(["status"], {"DEDUPE_STATUS_JSON": "off"}).json is False
    assert parse(["status"], {"DEDUPE_STATUS_JSON": "1"}).json is True


def test_every_command_and_every_argument_has_help() -> None:
    """A newcomer reading --help finds a description and no bare argument."""
    bare = [
        f"{command} {name_of(action)}"
        for command, _, action in options()
        if not (action.help or "").strip()
    ]
    undescribed = [c or "dedupe-worker" for c, p in commands(build_parser()) if not p.description]
    assert bare == [] and undescribed == []


def test_the_docs_and_the_help_name_every_option_that_reads_no_variable() -> None:
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    epilog = " ".join((build_parser().epilog or "").split())
    sentence = text.split("except", 1)[1].split(". ", 1)[0]
    for command, option in EXEMPT:
        if option.startswith("--"):
            named = option if option == "--yes" else f"{command} {option}"
            assert named in sentence and named in epilog, named
    assert "positional arguments" in sentence and "positional arguments" in epilog


def test_sizes_and_timeouts_below_their_minimum_are_usage_errors() -> None:
    """A pool of 0 connections or a store timeout of 0 s is refused with the variable's name,
    not a traceback from the driver."""
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["receive", "m:app", "--pool-size", "0"])
    args = parser.parse_args(["receive", "m:app"])
    with pytest.raises(UsageError, match="DEDUPE_RECEIVER_POOL_SIZE='0': expected a whole number"):
        read_environment(parser, args, {"DEDUPE_RECEIVER_POOL_SIZE": "0"})
    args = parser.parse_args(["receive", "m:app"])
    with pytest.raises(UsageError, match="DEDUPE_RECEIVER_STORE_TIMEOUT_S='0': expected a number"):
        read_environment(parser, args, {"DEDUPE_RECEIVER_STORE_TIMEOUT_S": "0"})
