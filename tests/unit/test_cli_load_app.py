"""load_app turns an error in the user's module into one line: where, what, what to do."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from dedupe.cli.options import UsageError, load_app
from dedupe.errors import ConfigurationError, DedupeError


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An importable folder, the current directory as in a real project."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def module(project: Path, source: str) -> str:
    """Write a module with a name no other test uses; return the name."""
    name = f"app_{uuid.uuid4().hex[:8]}"
    (project / f"{name}.py").write_text(source)
    return name


def test_a_syntax_error_names_the_file_and_line(project: Path) -> None:
    name = module(project, "from dedupe import App\n\ndef oops(:\n    pass\n")
    with pytest.raises(UsageError) as raised:
        load_app(f"{name}:app")
    message = str(raised.value)
    assert message.startswith(f"{name}.py:3: SyntaxError: invalid syntax")
    assert "fix that line" in message and "project's root" not in message


def test_an_indentation_error_names_the_file_and_line(project: Path) -> None:
    name = module(project, "x = 1\n  y = 2\n")
    with pytest.raises(UsageError, match=rf"^{name}\.py:2: IndentationError: "):
        load_app(f"{name}:app")


def test_an_exception_at_import_names_the_users_line_not_a_library_frame(project: Path) -> None:
    name = module(project, "import json\n\nCONFIG = json.loads('{')\n")
    with pytest.raises(UsageError) as raised:
        load_app(f"{name}:app")
    message = str(raised.value)
    assert message.startswith(f"{name}.py:3: importing '{name}' raised JSONDecodeError")
    assert "--log-level DEBUG" in message


def test_a_missing_dependency_is_named_without_advice_about_the_projects_root(
    project: Path,
) -> None:
    name = module(project, "import os\nimport no_such_dependency_x\n")
    with pytest.raises(UsageError) as raised:
        load_app(f"{name}:app")
    message = str(raised.value)
    assert message.startswith(f"{name}.py:2: module '{name}' imports 'no_such_dependency_x'")
    assert "not installed" in message and "project's root" not in message


def test_a_missing_module_itself_suggests_the_projects_root(project: Path) -> None:
    for target in ("nowhere_x:app", "nowhere_x.payments:app"):
        with pytest.raises(UsageError, match=r"cannot import module .*project's root"):
            load_app(target)


def test_a_registration_error_keeps_its_advice_and_gains_the_line(project: Path) -> None:
    source = (
        "from dedupe import App\napp = App('shop')\n\n"
        "@app.handler('payments')\ndef charge(event: dict) -> None:\n    pass\n"
    )
    name = module(project, source)
    with pytest.raises(ConfigurationError) as raised:
        load_app(f"{name}:app")
    assert str(raised.value).startswith(f"{name}.py:4: ")
    assert "async def" in str(raised.value)


def test_every_import_error_is_a_dedupe_error_so_the_command_exits_1(project: Path) -> None:
    name = module(project, "raise KeyError('boom')\n")
    with pytest.raises(DedupeError, match=r":1: importing .* raised KeyError: 'boom'"):
        load_app(f"{name}:app")
