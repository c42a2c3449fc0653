"""`dedupe-worker receive --http`: h11 unless asked otherwise; httptools asked for but missing
is a usage error before anything connects."""

from __future__ import annotations

import importlib.util

import pytest

from dedupe.cli import build_parser, main
from dedupe.cli.options import read_environment


def test_h11_is_the_default_and_the_variable_can_change_it() -> None:
    parser = build_parser()
    args = parser.parse_args(["receive", "handlers.webhooks:app"])
    read_environment(parser, args, {})
    assert args.http == "h11"
    args = parser.parse_args(["receive", "handlers.webhooks:app"])
    read_environment(parser, args, {"DEDUPE_RECEIVER_HTTP": "httptools"})
    assert args.http == "httptools"


def test_httptools_asked_for_but_missing_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "httptools" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    # An unreachable database: had the check come after connecting, this would wait there.
    monkeypatch.setenv("DEDUPE_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("DEDUPE_CONNECT_TIMEOUT_S", "0")
    assert main(["receive", "handlers.webhooks:app", "--http", "httptools"]) == 1
    assert "--http httptools: httptools is not installed; pip install httptools" in (
        capsys.readouterr().err
    )
