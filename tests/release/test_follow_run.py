"""examples/follow_run.py: a short run writes its page with every row, and its figure."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests import scripts
from tests.paths import ROOT

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")  # examples/lm_spikes.py, whose page header it shares

# Slow, `make test` skips it: runs examples/follow_run.py (closed-loop regressions, every row).
pytestmark = pytest.mark.slow

SCRIPT = scripts.Script(ROOT / "examples" / "follow_run.py", "clipjax_follow_run")


def test_short_run_writes_the_page_with_every_row(tmp_path: Path) -> None:
    fr = SCRIPT.load()
    # SGD only: one compilation per row (the adam rows are the same code).
    options = ["--steps", "60", "--change", "30", "--late", "40", "--optimizers", "sgd"]
    results = fr.main([*options, "--out", str(tmp_path)])
    page = (tmp_path / "follow_run.md").read_text()
    assert f"Command: `python examples/follow_run.py {' '.join(options)}`" in page
    assert str(tmp_path) not in page and "--out" not in page
    assert "Machine:" in page and "Versions: Python" in page and "Date: 20" in page
    tables = page.split("## ")[1:2]  # one table per optimizer
    assert [t.splitlines()[0] for t in tables] == [fr.OPTIMIZERS["sgd"][1]]
    assert fr.OPTIMIZERS["adam"][1] not in page
    for table in tables:
        names = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
        assert names[1:] == [row.name for row in fr.ROWS]
    assert (tmp_path / "follow_run.png").stat().st_size > 10_000
    # The table's figures are the traces': the final loss of SGD alone, and the
    # static clip clips exactly the late steps whose norm is above its max_norm.
    sgd_none = results[("sgd", "none")]
    assert f"| none | {sgd_none.loss[29]:.3g} | {sgd_none.loss[-1]:.3g} |" in page
    static = results[("sgd", "static")]
    np.testing.assert_array_equal(static.clipped, static.grad_norm > fr.STATIC_MAX_NORM)
    assert np.all(static.threshold == fr.STATIC_MAX_NORM)
    # The population loss is |w - w_true|^2 + NOISE^2: at least the noise floor.
    assert all(np.all(t.loss >= fr.NOISE**2 * (1 - 1e-6)) for t in results.values())
    # A clipjax row reports its threshold from clipjax.metrics.
    assert np.isfinite(results[("sgd", "zclip_percentile")].threshold[20:]).all()
    assert not re.search(r"(?<![\w.])(~?/)[A-Za-z_]", page.split("## Settings")[0])


def test_bad_step_order_is_refused() -> None:
    fr = SCRIPT.load()
    with pytest.raises(SystemExit):
        fr.parse_args(["--steps", "50", "--change", "60"])
    with pytest.raises(SystemExit):
        fr.parse_args(["--optimizers", "lion"])
    assert fr.parse_args([]).optimizers == ["sgd", "adam"]
