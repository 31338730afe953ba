"""examples/demo.py: a short run prints the table and writes the figure and CSVs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import scripts
from tests.paths import ROOT

pytest.importorskip("flax")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

# Slow, `make test` skips it: runs examples/demo.py (13 training runs at full size).
pytestmark = pytest.mark.slow

DEMO = scripts.Script(ROOT / "examples" / "demo.py", "clipjax_demo", timeout=600)


def test_short_run_prints_table_and_writes_figure(tmp_path: Path) -> None:
    # One setting without clipjax metrics (optax), one global, one per layer,
    # and a name longer than the others' padding used to be.
    names = ["optax", "zclip", "agc", "autoclip_p95+clipped"]
    result = DEMO.run("--steps", "60", "--clippers", ",".join(names), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    lines = out.splitlines()

    # Captured output is not a terminal: no progress bar frames, one plain
    # progress line per run (the spike-free reference first).
    assert "\r" not in out and "\r" not in result.stderr, result.stderr[-500:]
    assert "it/s" not in result.stderr and "step/s" not in result.stderr
    progress = [line for line in lines if " steps in " in line]
    assert [line.split()[0] for line in progress] == ["spike-free", *names], out
    # The settings' descriptions and the progress figures start in one column.
    described = lines[1 : 1 + len(names)]
    assert [line.split()[0] for line in described] == names, out
    columns = {line.index(line.split()[1], len(line.split()[0]) + 2) for line in described}
    assert len(columns) == 1, described
    assert len({line.index(" 60 steps in ") for line in progress}) == 1, progress

    start = next(i for i, line in enumerate(lines) if line.startswith("setting"))
    for column in ("final loss", "worst jump", "steps clipped"):
        assert column in lines[start]
    # No step time: on this model it measures call overhead (benchmarks/RESULTS.md times steps).
    assert "ms/step" not in lines[start]
    table = {line.split()[0]: line for line in lines[start + 2 : start + 2 + len(names)]}
    assert list(table) == names, out
    for row in table.values():
        assert "/ 60" in row, out
    assert (tmp_path / "spikes.png").stat().st_size > 10_000
    for name in names:
        header_line = (tmp_path / f"{name}.csv").read_text().splitlines()[0]
        assert "eval_loss" in header_line
    assert "zclip/global/threshold" in (tmp_path / "zclip.csv").read_text().splitlines()[0]
    assert "agc/hidden1/target" in (tmp_path / "agc.csv").read_text().splitlines()[0]


def test_help_and_bad_setting() -> None:
    options = ("--clippers", "--steps", "--out", "--spike-steps")
    DEMO.check_help_and_refusal(options, "--clippers", "nope")


def test_summary_of_synthetic_rows() -> None:
    demo = DEMO.load()
    x = dict(grad_norm=1.0, threshold=10.0, scale=1.0, clipped=0.0)
    x = {f"x/global/{k}": v for k, v in x.items()}
    rows = [{"step": i, "eval_loss": 1.0, "seconds": 0.001, **x} for i in range(10)]
    rows[5].update({"x/global/grad_norm": 100.0, "x/global/scale": 0.02, "x/global/clipped": 1.0})
    rows[6]["eval_loss"] = 3.0
    summary = demo.summarize(rows, [5])
    assert summary.steps_clipped == 1
    assert summary.worst_jump == pytest.approx(3.0)
    assert summary.passed == pytest.approx(2.0)
    assert summary.final_loss == 1.0
