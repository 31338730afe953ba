"""examples/lm_spikes.py: a --quick run writes the table and the figure for every setting."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "lm_spikes.py"
ROOT = SCRIPT.parents[1]


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def load_script():
    spec = importlib.util.spec_from_file_location("clipjax_lm_spikes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks the module up there
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_table_and_figure(tmp_path: Path) -> None:
    # One setting without clipjax metrics (optax's static clip), one with.
    names = ["static_1", "zclip"]
    result = run_script(
        "--quick", "--seeds", "2", "--only", ",".join(names), "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "lm_spikes.md").read_text()
    assert "Machine:" in table and "jax " in table
    rows = {
        line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")
    }
    assert "setting" in rows
    for name in names:
        assert name in rows, table
        assert "unavailable" not in rows[name]
        assert rows[name].count("|") == rows["setting"].count("|")
        assert name in result.stdout
    assert (tmp_path / "lm_spikes.png").stat().st_size > 10_000
    curves = np.load(tmp_path / "lm_spikes.npz")
    assert curves["zclip/loss"].shape == (2, 40)
    assert np.isfinite(curves["zclip/eval_loss"]).all()
    # Read from the optimizer state every step: at most one per step and seed.
    assert 0 <= curves["zclip/clipped"].sum() <= 2 * 40


def test_help_and_bad_setting() -> None:
    result = run_script("--help")
    assert result.returncode == 0
    for option in ("--seeds", "--steps", "--only", "--quick", "--out", "--static-sweep"):
        assert option in result.stdout
    result = run_script("--only", "nope")
    assert result.returncode == 2
    assert "unknown setting" in result.stderr


def test_spike_measures_on_synthetic_curves() -> None:
    lm = load_script()
    steps = 400
    loss = np.linspace(3.0, 1.5, steps)
    norm = np.ones(steps)
    assert lm.spike_events(loss, norm) == (0, 0.0, 0)
    # A set-back of 0.5 nats over 40 steps, then recovery; one gradient spike.
    loss[200:240] += 0.5
    norm[199] = 50.0
    events, largest, grad_spikes = lm.spike_events(loss, norm)
    assert events == 1
    assert 0.35 < largest <= 0.5  # less the fall of the trend under the 20-step average
    assert grad_spikes == 1
    # A NaN ends the measures at the first non-finite loss.
    loss[300:] = np.nan
    assert lm.spike_events(loss, norm)[0] == 1
