"""benchmarks/activation.py runs and writes its page (the times it measures are not
asserted; XLA's bytes accessed are repeatable: the function adds a few per mille)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

# Slow, `make test` skips it: compiles the benchmark's five steps of the smallest model.
pytestmark = pytest.mark.slow


def test_the_cost_benchmark_writes_its_page(tmp_path: Path) -> None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import activation

    figures = activation.main(["--sizes", "tiny", "--rounds", "1", "--out", str(tmp_path)])
    page = (tmp_path / "ACTIVATION.md").read_text()
    assert "python benchmarks/activation.py --sizes tiny --rounds 1" in page
    assert str(tmp_path) not in page
    assert "## Size tiny" in page
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(activation.ROWS)
    for name in activation.ROWS:
        if name != activation.BASE:
            assert 1.0 < figures[f"tiny {name} bytes"] < 1.02, name
            assert f"tiny {name} step" in figures
