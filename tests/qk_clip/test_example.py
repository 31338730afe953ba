"""examples/qk_clip_muon.py: without QK-Clip the max logit passes tau; with the logits of the
updated weights it stays at tau (1 + 1e-3) after every step; the page and figure are written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optax
import pytest

from tests import scripts
from tests.paths import ROOT

# Slow, `make test` skips it: trains the example's three settings for 300 steps (about 80 s).
pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "qk_clip_muon.py"


def test_the_example_shows_qk_clip_bounding_the_logits(tmp_path: Path) -> None:
    if not hasattr(optax.contrib, "muon"):
        pytest.skip("optax.contrib.muon is newer than this optax")
    example = scripts.load(EXAMPLE, "clipjax_qk_clip_muon")
    runs = example.main(["--out", str(tmp_path)])
    tau = example.Config.tau
    alone, forward, updated = (runs[name] for name in example.SETTINGS)
    assert alone.after.max() > 2 * tau  # grows past tau without QK-Clip
    assert alone.clipped_heads.sum() == 0
    assert np.all(updated.after <= tau * (1 + 1e-3))
    assert updated.after.max() >= tau * (1 - 1e-3)  # and it was reached
    # The K2 rule on the forward pass's logits: pulled back every step, above tau by one
    # step's growth only.
    assert forward.clipped_heads.sum() > 0
    assert forward.after.max() < 1.5 * tau < alone.after.max()
    for run in runs.values():
        assert np.all(np.isfinite(run.loss)) and run.loss[-20:].mean() < 3.0
    page = (tmp_path / "qk_clip_muon.md").read_text()
    assert "python examples/qk_clip_muon.py" in page and "| muon + qk_clip |" in page
