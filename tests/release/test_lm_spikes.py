"""examples/lm_spikes.py: the CPU configuration's --quick run writes its page and figure."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from tests import scripts
from tests.paths import ROOT

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

pytestmark = pytest.mark.slow  # trains the byte-level transformer of examples/lm_spikes.py

SCRIPT = scripts.Script(ROOT / "examples" / "lm_spikes.py", "clipjax_lm_spikes")


def test_cpu_quick_run_writes_the_page(tmp_path: Path) -> None:
    # One setting without clipjax metrics (optax's static clip, from the sweep), one
    # with, one inside skip_on_spike; --npz adds the per-step curves.
    names = ["none", "recommended", "skip"]
    result = SCRIPT.run(
        "--config", "cpu", "--quick", "--seeds", "2", "--only", ",".join(names),
        "--static-sweep", "1", "--npz", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    page = (tmp_path / "lm_spikes_cpu_seeds2.md").read_text()  # not 6 seeds: named so
    # What produced it, and nothing about where: no machine paths, no output folder.
    command = "python examples/lm_spikes.py --config cpu --quick --seeds 2"
    assert f"Command: `{command}" in page
    assert "--out" not in page and str(tmp_path) not in page
    # An absolute or home path starts a word with "/" or "~/" followed by a name
    # (per-seed figures are separated by " / ", metric names hold "a/b").
    assert not re.search(r"(?<![\w.])(~?/)[A-Za-z_]", page), page
    assert "Machine:" in page and "Date: 20" in page
    assert "vs best static, paired" in page and "share capped" in page
    for package in ("jax ", "jaxlib ", "optax ", "flax ", "clipjax "):
        assert package in page.split("Versions:")[1].splitlines()[0], package
    headings = [line for line in page.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings)) >= 3
    tables = [line for line in page.splitlines() if line.startswith("| ")]
    rows: dict[str, list[str]] = {}
    for line in tables:
        rows.setdefault(line.split("|")[1].strip(), []).append(line)
    for name in [*names, "static_1"]:
        assert len(rows[name]) == 2, page  # one row in each table
        assert "unavailable" not in rows[name][0]
        assert name in result.stdout
    # Per-seed figures: the final loss of both seeds in the loss table; the
    # largest jump and the share of steps clipped of both seeds in the other.
    assert rows["recommended"][0].split("|")[4].count(" / ") == 1
    spike_cells = [c.strip() for c in rows["static_1"][1].split("|")[1:-1]]
    spike_table = next(r for r in tables if r.startswith("| setting | loss spikes"))
    header = [c.strip() for c in spike_table.split("|")[1:-1]]
    jump, share = (spike_cells[header.index(c)] for c in ("largest jump", "share clipped"))
    assert jump.count(" / ") == 1 and jump.startswith("x")
    assert share.count(" / ") == 1 and share.count("%") == 2
    assert "ln 256" in page
    assert "Best static clip: `static_1`" in page
    assert "(lm_spikes_cpu_seeds2.png)" in page
    assert (tmp_path / "lm_spikes_cpu_seeds2.png").stat().st_size > 10_000
    curves = np.load(tmp_path / "lm_spikes_cpu_seeds2.npz")
    assert curves["recommended/loss"].shape == (2, 40)
    assert np.isfinite(curves["recommended/eval_loss"]).all()
    # Read from the optimizer state every step: at most one per step and seed.
    assert 0 <= curves["recommended/clipped"].sum() <= 2 * 40
    # static_1 clips exactly the steps whose raw norm exceeds 1.
    np.testing.assert_array_equal(curves["static_1/clipped"], curves["static_1/grad_norm"] > 1.0)


def test_a_loss_scale_scales_the_sweep_not_clip_1(tmp_path: Path) -> None:
    """--loss-scale 10: the gradients are 10x, the sweep's clip too (static_1 clips at
    10, the same steps as at x 1), clip_1 stays at 1.0 and clips every step; the
    recommended setting is the same run; the page says so and has its own name."""
    runs = {}
    for k in ("1", "10"):
        out = tmp_path / k
        result = SCRIPT.run(
            "--config", "cpu_long", "--quick", "--seeds", "1", "--only", "recommended,clip_1",
            "--static-sweep", "1", "--npz", "--loss-scale", k, "--out", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        stem = "lm_spikes_cpu_long" if k == "1" else "lm_spikes_cpu_long_loss_x10"
        stem += "_seeds1"  # a page of other than 6 seeds says its count
        runs[k] = np.load(out / f"{stem}.npz")
        page = (out / f"{stem}.md").read_text()
    assert "loss x 10" in page and "--loss-scale 10" in page and "clip_1 stays at 1.0" in page
    one, ten = runs["1"], runs["10"]
    # Training amplifies float32 rounding (k x the gradient is not exact), so the
    # runs agree closely at first and to a few percent at the end.
    early = np.s_[:, :5]
    np.testing.assert_allclose(
        ten["static_1/grad_norm"][early], 10 * one["static_1/grad_norm"][early], rtol=1e-3
    )
    np.testing.assert_array_equal(ten["static_1/clipped"][early], one["static_1/clipped"][early])
    for row in ("static_1", "recommended"):
        np.testing.assert_allclose(ten[f"{row}/eval_loss"], one[f"{row}/eval_loss"], rtol=0.03)
    assert ten["clip_1/clipped"].all() and not one["clip_1/clipped"].all()


def test_command_and_unavailable_rows() -> None:
    lm = SCRIPT.load()
    assert lm.command(["--config", "cpu", "--out", "/x/y", "--seeds", "3"]) == (
        "python examples/lm_spikes.py --config cpu --seeds 3"
    )
    assert lm.command(["--out=/x"]) == "python examples/lm_spikes.py"
    settings = lm.settings_for(lm.CONFIGS["cpu"])
    names = list(settings)
    assert names[:5] == ["none", "static_0.25", "static_0.5", "static_1", "static_2"]
    required = ["autoclip", "autoclip_fb", "autoclip_fb_window", "zscore_clip", "zscore_clip_fb",
                "zclip", "zclip_fb_cap1", "zclip_fb_nocap", "zclip_nocap_w10", "hist_clip",
                "hist_clip_fb", "adagc", "low_lr", "skip", "skip_recommended", "skip_fb_skip",
                "recommended", "clip_1"]  # fmt: skip
    assert set(required) <= set(names), sorted(set(required) - set(names))
    # One row list; every row in a panel of the figure; the recommended rows
    # name the one RECOMMENDED constant.
    assert [n for n, _ in lm.ROWS] == list(lm.SETTINGS)
    assert {s.panel for s in settings.values()} <= set(lm.PANELS)
    assert lm.RECOMMENDED in settings["recommended"].about
    # ... and that constant is the documentation's one recommended setting.
    with open(os.path.join(ROOT, "docs", "generated", "recommended.md")) as f:
        assert f"`clipjax.{lm.RECOMMENDED}`" in f.read()
    assert lm.RECOMMENDED in settings["skip_recommended"].about
    # The CPU configuration's half-learning-rate row.
    assert lm.CONFIGS["cpu"].low_lr_factor == 0.5
    loss_rows, spike_rows = lm.table_rows({}, ["skip_fb_skip"], 3)
    assert loss_rows[0][:2] == ["skip_fb_skip", "unavailable"]
    assert len(loss_rows[0]) == len(lm.LOSS_HEADER)
    assert len(spike_rows[0]) == len(lm.SPIKE_HEADER)


def test_help_and_bad_setting() -> None:
    options = ("--seeds", "--steps", "--only", "--quick", "--out", "--static-sweep", "--loss-scale")
    SCRIPT.check_help_and_refusal(options, "--only", "nope")


def test_spike_measures_on_synthetic_curves() -> None:
    lm = SCRIPT.load()
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
    assert lm.largest_jump(loss) == np.inf


def test_one_definition_of_diverged() -> None:
    lm = SCRIPT.load()
    loss = np.full((4, 10), 2.0)
    loss[1, 5] = np.nan  # a batch loss not finite
    final = np.array([2.0, 2.0, np.log(256) + 0.01, np.inf])
    np.testing.assert_array_equal(lm.diverged(loss, final), [False, True, True, True])
    assert not lm.diverged(loss[:1], np.array([np.log(256)]))[0]


def test_largest_jump_against_a_direct_computation() -> None:
    lm = SCRIPT.load()
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.05 * rng.standard_normal(300)
    loss[150] = 3.1
    expected = max(loss[t] / np.median(loss[t - 50 : t]) for t in range(50, 300))
    assert lm.largest_jump(loss) == pytest.approx(expected)
    assert lm.largest_jump(loss) == pytest.approx(3.1 / np.median(loss[100:150]))


def test_paired_comparison_calls_a_difference_only_when_consistent() -> None:
    lm = SCRIPT.load()
    reference = np.full(6, 2.0)
    verdict, mean, low, high, worse = lm.paired(
        reference * [1.05, 1.04, 1.06, 1.05, 1.03, 1.05], reference
    )
    assert verdict == "worse" and worse == 6 and 0 < low < mean < high
    verdict, *_, worse = lm.paired(reference * [1.2, 0.9, 1.1, 0.95, 1.0, 1.02], reference)
    assert verdict == "tie" and worse == 3
    verdict, *_ = lm.paired(reference * 0.9, reference)
    assert verdict == "better"
    # A diverged seed counts as ln 256, not as a missing value.
    final = np.array([np.nan, 1e4, 2.0, 2.0, 2.0, 2.0])
    _, mean, *_ = lm.paired(final, reference)
    assert mean == pytest.approx(2 * np.log(np.log(256) / 2.0) / 6)
    cell = lm.paired_cell(reference * 1.05, reference)
    assert cell.startswith("worse: +5.0%") and cell.endswith("6/6 worse")
