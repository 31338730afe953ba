"""``examples/data_parallel.py`` runs on 8 devices and its three runs agree."""

from __future__ import annotations

import pytest

from tests import scripts
from tests.paths import ROOT

EXAMPLE = ROOT / "examples" / "data_parallel.py"


def test_data_parallel_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    module = scripts.load(EXAMPLE, "data_parallel_example")
    module.main(["--steps", "8", "--spike-step", "6"])
    out = capsys.readouterr().out
    assert out.startswith("8 devices")
    assert "trained the same parameters" in out
    # The spike is clipped in all three runs, with the same scale.
    spike_lines = [line for line in out.splitlines() if "step   6" in line]
    assert len(spike_lines) == 3
    assert len({line.split("scale")[1] for line in spike_lines}) == 1
    assert all(float(line.split("scale")[1]) < 1 for line in spike_lines)
