"""tests/conftest.py's SERIAL list (what `make test` runs alone, after the parallel phase) names
tests that exist: a renamed file or test would otherwise run in parallel unnoticed."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, SERIAL


@pytest.mark.parametrize("entry", sorted(SERIAL))
def test_each_serial_entry_names_a_folder_a_file_or_a_test_that_exists(entry: str) -> None:
    path, _, test = entry.partition("::")
    target = ROOT / path
    if path.endswith("/"):
        assert target.is_dir() and any(target.glob("test_*.py")), entry
    else:
        assert target.is_file(), entry
    if test:
        assert re.search(rf"^(async )?def {re.escape(test)}\(", target.read_text(), re.M), entry
    assert SERIAL[entry].strip(), f"{entry}: say why it must run alone"
