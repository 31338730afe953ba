"""benchmarks/spectral_clip.py runs and writes its page (its times are not asserted)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

# Slow, `make test` skips it: compiles and times six optimizer steps of the small tree.
pytestmark = pytest.mark.slow


def test_the_cost_benchmark_writes_its_page(tmp_path: Path) -> None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import spectral_clip

    spectral_clip.main(["--quick", "--out", str(tmp_path)])
    page = (tmp_path / "SPECTRAL_CLIP.md").read_text()
    assert "python benchmarks/spectral_clip.py --quick" in page
    assert str(tmp_path) not in page
    rows = [line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| ")]
    assert rows[1:] == list(spectral_clip.CONFIGS)
    for line in page.splitlines()[-len(spectral_clip.CONFIGS) :]:
        assert float(line.split("|")[3]) > 0, line
