"""docs/configuration.md stays in step with the settings and the command line."""

from __future__ import annotations

from dedupe.cli.reference import MEANING, reference
from dedupe.settings import Settings
from tests.conftest import ROOT


def test_every_setting_has_a_meaning() -> None:
    assert set(MEANING) == set(Settings.model_fields)


def test_the_configuration_reference_is_the_generated_one() -> None:
    """Regenerate with: python -m dedupe.cli.reference (between the reference markers)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    documented = text.split("<!-- reference:begin -->\n", 1)[1].split("<!-- reference:end -->")[0]
    assert documented == reference()


def test_every_environment_variable_is_documented() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`DEDUPE_{name.upper()}`" in text
