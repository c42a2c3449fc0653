"""The CLI runs on uvloop when it is installed (`auto`), and says so when it is asked for but
missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from dedupe.cli import main
from dedupe.cli.options import UsageError, loop_factory


def test_auto_picks_uvloop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop


def test_asyncio_keeps_the_default_loop() -> None:
    assert loop_factory("asyncio") is None


def test_a_missing_uvloop_is_fine_on_auto_and_an_error_when_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    assert loop_factory("auto") is None
    with pytest.raises(UsageError, match=r"pip install 'dedupe-worker\[uvloop\]'"):
        loop_factory("uvloop")


def test_the_command_runs_its_coroutine_on_the_chosen_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop = pytest.importorskip("uvloop")
    seen: list[type] = []

    async def record(args: object, settings: object) -> int:
        seen.append(type(asyncio.get_running_loop()))
        return 0

    import dedupe.cli as cli

    parser = cli.build_parser()
    real_parse = parser.parse_args

    def parse(argv: object = None) -> object:
        args = real_parse(argv)  # type: ignore[arg-type]
        args.handler = record
        return args

    monkeypatch.setattr(parser, "parse_args", parse)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert main(["migrate", "--event-loop", "uvloop"]) == 0
    assert main(["migrate", "--event-loop", "asyncio"]) == 0
    assert seen == [uvloop.Loop, asyncio.SelectorEventLoop]
