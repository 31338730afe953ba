"""benchmarks/qk_clip_cost.py runs and writes its page (the figures it times are not asserted;
XLA's bytes accessed are repeatable: the transform adds almost none)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import optax
import pytest

from tests.paths import ROOT

# Slow, `make test` skips it: compiles the benchmark's twelve steps of the smallest model.
pytestmark = pytest.mark.slow


def test_the_cost_benchmark_writes_its_page(tmp_path: Path) -> None:
    if not hasattr(optax.contrib, "muon"):
        pytest.skip("optax.contrib.muon is newer than this optax")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import qk_clip_cost

    figures = qk_clip_cost.main(["--size", "tiny", "--rounds", "1", "--out", str(tmp_path)])
    page = (tmp_path / "QK_CLIP_COST.md").read_text()
    assert "python benchmarks/qk_clip_cost.py --size tiny --rounds 1" in page
    assert str(tmp_path) not in page
    for layout in ("Unscanned", "Scanned"):
        assert f"## {layout} layers" in page
    assert {f"{layout} {opt} transform" for layout in ("unscanned", "scanned")
            for opt in ("adamw", "muon")} <= set(figures)  # fmt: skip
    bytes_ratios = [
        float(line.split("|")[5])
        for line in page.splitlines()
        if line.startswith("| `") and "+ qk_clip`" in line
    ]
    assert len(bytes_ratios) == 4 and max(bytes_ratios) < 1.05
