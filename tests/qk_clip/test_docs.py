"""docs/qk_clip.md: every code block runs and prints what its comment says (the two flax
recipes in tests/qk_clip/test_flax.py, which is slow)."""

from __future__ import annotations

from typing import Any

import optax
import pytest

from tests.docs.markdown_tables import python_blocks
from tests.paths import ROOT

PAGE = ROOT / "docs" / "qk_clip.md"


def run(index: int, capsys: pytest.CaptureFixture) -> tuple[dict[str, Any], str]:
    """Runs block ``index`` of the page: its namespace and what it printed."""
    namespace: dict[str, Any] = {}
    exec(compile(python_blocks(PAGE)[index], str(PAGE), "exec"), namespace)
    return namespace, capsys.readouterr().out


def test_the_page_has_its_six_blocks() -> None:
    assert len(python_blocks(PAGE)) == 6


@pytest.mark.parametrize(
    ("index", "printed"),
    [
        (0, ["2 0.25"]),
        (1, []),
        (2, ["qk_clip: optimizer must be an optax GradientTransformation", "True", "2"]),
        (3, ["True"]),  # the helper equals the materialised logits' max
    ],
    ids=["the first example", "the layouts build", "the wrong wirings raise", "the helper"],
)
def test_the_block_prints_what_its_comment_says(
    index: int, printed: list[str], capsys: pytest.CaptureFixture
) -> None:
    if index in (0, 2) and not hasattr(optax.contrib, "muon"):
        pytest.skip("optax.contrib.muon is newer than this optax")
    assert run(index, capsys)[1].splitlines() == printed
