"""Following a run: the spike defences stop spikes without turning into a static clip.

On ``benchmarks/follow.py``'s grid (lognormal noise sigma in {0.05, 0.1, 0.2}, a lasting
x k shift at step 300, k in {0.25, 2, 4, 10}, x10 spikes; base level 0.05 under an absolute
ceiling, else 1) a setting follows a run when, on every cell and seed, its share of
clipped non-spike steps from 120 steps after the shift is at most 5 points above that
before it, its threshold over the level stays within x1.5 of before, and no spike
reaches the optimizer above 2x the level of its step.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tests.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import follow

import clipjax

SEEDS = 3


def _failures(cells: dict) -> list[str]:
    return [
        f"sigma {s}, x{k}: clipped before {c.clipped_before}, after {c.clipped_after}, "
        f"threshold / level drift {c.drift()}, worst spike {c.worst_spike.max():.2f}x"
        for (s, k), c in cells.items()
        if not c.follows()
    ]


@pytest.mark.parametrize("name", follow.REQUIRED)
def test_required_settings_follow_a_run(name: str) -> None:
    cells = follow.evaluate(follow.SETTINGS[name], SEEDS)
    assert len(cells) == len(follow.SIGMAS) * len(follow.LEVELS)
    assert not _failures(cells), f"{name} does not follow a run:\n" + "\n".join(_failures(cells))


@pytest.mark.parametrize(
    "make, ratchets",
    [
        (lambda: clipjax.zclip(max_grad_norm=None), True),
        (lambda: clipjax.hist_clip(feedback="clip_target"), True),
        (lambda: clipjax.zclip(feedback="clipped", max_grad_norm=None), False),
    ],
    ids=["zclip-clip_target", "hist_clip-clip_target", "zclip-clipped"],
)
def test_a_lasting_x2_rise(make, ratchets: bool) -> None:
    """The figure in the docstrings: after a x2 shift with 5% noise the clip target rule
    clips every later step (its statistics can never rise); "clipped" learns the rise."""
    after = follow.evaluate(make, SEEDS, sigmas=(0.05,), levels=(2.0,))[(0.05, 2.0)].clipped_after
    assert (after == 1.0).all() if ratchets else (after <= 0.05).all(), after


@pytest.mark.parametrize(
    "make",
    [
        lambda: clipjax.zclip(feedback="clipped", max_grad_norm=1.0),
        lambda: clipjax.autoclip(feedback="clipped"),
    ],
    ids=["zclip", "autoclip"],
)
def test_a_ceiling_is_judged_on_the_scaled_grid(make) -> None:
    """A setting with an absolute ceiling (max_grad_norm=1.0) follows a run on the grid
    scaled below it (base 0.05); on the unscaled grid, after a lasting rise
    above the ceiling it is a static clip at 1.0: it clips every later step and
    says so in its ``capped`` metric."""
    assert follow.has_ceiling(make())
    scaled = follow.evaluate(make, SEEDS)
    assert not _failures(scaled), "\n".join(_failures(scaled))
    above = follow.evaluate(make, SEEDS, sigmas=(0.05,), levels=(4.0,), base=1.0)
    assert (above[(0.05, 4.0)].clipped_after == 1.0).all()
    norms, _, _ = follow.stream(0, 0.05, 4.0)
    tx = make()
    params = {"w": np.zeros(1, np.float32)}
    state = tx.init(params)
    capped = []
    for g in norms[follow.AFTER : follow.AFTER + 20]:
        _, state = tx.update({"w": np.array([g], np.float32)}, state, params)
        metrics = clipjax.metrics(state)
        capped.append(bool(next(v for k, v in metrics.items() if k.endswith("/capped"))))
    assert all(capped)


def test_a_relative_ceiling_is_judged_on_the_grid_itself() -> None:
    """zclip(feedback="clipped") has no absolute number: the same at base 1 and 0.05."""
    make = lambda: clipjax.zclip(feedback="clipped")
    assert not follow.has_ceiling(make())
    for base in (1.0, 0.05):
        cells = follow.evaluate(make, SEEDS, base=base)
        assert not _failures(cells), (base, _failures(cells))


def test_a_static_clip_below_the_level_does_not_follow() -> None:
    cells = follow.evaluate(lambda: clipjax.clip_by_global_norm(1.0), SEEDS, levels=(4.0,))
    assert not any(c.follows() for c in cells.values())


def test_whole_history_autoclip_lets_spikes_through_after_a_drop() -> None:
    """Why the judge-first default history is the window: the whole history
    remembers the old level, so after a x0.25 drop spikes pass at several times
    the new level."""
    make = lambda: clipjax.autoclip(feedback="clipped", history="all", max_grad_norm=None)
    cells = follow.evaluate(make, SEEDS, sigmas=(0.1,), levels=(0.25,))
    assert cells[(0.1, 0.25)].worst_spike.max() > 2 * follow.MAX_PASSED


def test_grid_stream_has_the_shift_and_the_spikes() -> None:
    norms, levels, spikes = follow.stream(0, 0.1, 4.0)
    assert len(norms) == follow.STEPS and len(spikes) == 8
    assert (levels[: follow.SHIFT] == 1).all() and (levels[follow.SHIFT :] == 4).all()
    before = spikes[spikes < follow.SHIFT]
    after = spikes[spikes >= follow.SHIFT]
    assert len(before) == 4 and (before >= 100).all()
    assert len(after) == 4 and (after >= follow.SPIKES_AFTER).all()
    ratio = norms[spikes] / levels[spikes]
    assert (ratio > 5).all() and np.median(norms[: follow.SHIFT]) == pytest.approx(1, rel=0.1)


def test_adagc_follows_a_rise_at_most_point_one_percent_a_step() -> None:
    """adagc's figures in its docstring: gamma grows at most (1-beta)(lambda-1)
    per step, so after a lasting x2 rise it clips (nearly) every measured step."""
    cells = follow.evaluate(
        lambda: clipjax.adagc(scope="global"), SEEDS, sigmas=(0.05, 0.2), levels=(2.0, 10.0)
    )
    for cell in cells.values():
        assert (cell.clipped_after >= 0.99).all()
        assert cell.worst_spike.max() <= 1.12
    stationary = follow.evaluate(
        lambda: clipjax.adagc(scope="global"), SEEDS, sigmas=(0.05, 0.2), levels=(0.25,)
    )
    assert stationary[(0.05, 0.25)].clipped_before.min() >= 0.4
    assert stationary[(0.2, 0.25)].clipped_before.min() >= 0.9
    tx = clipjax.adagc(scope="global", warmup_steps=1)
    params = {"w": np.zeros(1, np.float32)}
    state = tx.init(params)
    gammas = []
    for g in [1.0] + [100.0] * 50:
        _, state = tx.update({"w": np.array([g], np.float32)}, state, params)
        gammas.append(float(clipjax.metrics(state)["adagc/global/mean"]))
    growth = np.diff(gammas[1:]) / np.array(gammas[1:-1])
    assert growth.max() <= (1 - 0.98) * (1.05 - 1) * (1 + 1e-4)
