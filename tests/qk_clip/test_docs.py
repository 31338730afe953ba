"""docs/qk_clip.md: every code block runs and prints what its comment says (the two flax
recipes in tests/qk_clip/test_flax.py, which is slow)."""

from __future__ import annotations

import re
from typing import Any

import optax
import pytest

from tests.paths import ROOT

PAGE = ROOT / "docs" / "qk_clip.md"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def run(block: str, capsys: pytest.CaptureFixture) -> tuple[dict[str, Any], str]:
    namespace: dict[str, Any] = {}
    exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace, capsys.readouterr().out


def test_the_page_has_its_six_blocks() -> None:
    assert len(blocks()) == 6


def test_the_first_example(capsys: pytest.CaptureFixture) -> None:
    if not hasattr(optax.contrib, "muon"):
        pytest.skip("optax.contrib.muon is newer than this optax")
    _, out = run(blocks()[0], capsys)
    assert out.split() == ["2", "0.25"]


def test_the_layouts_build(capsys: pytest.CaptureFixture) -> None:
    run(blocks()[1], capsys)


def test_the_wrong_wirings_raise(capsys: pytest.CaptureFixture) -> None:
    if not hasattr(optax.contrib, "muon"):
        pytest.skip("optax.contrib.muon is newer than this optax")
    _, out = run(blocks()[2], capsys)
    assert out.splitlines() == [
        "qk_clip: optimizer must be an optax GradientTransformation",
        "True",
        "2",
    ]


def test_the_helper_equals_the_materialised_logits(capsys: pytest.CaptureFixture) -> None:
    _, out = run(blocks()[3], capsys)
    assert out.strip() == "True"
