"""Protecting a run from its first step, on the recorded norms of a real run.

``benchmarks/replay.py`` replays the recorded unclipped gradient norms of the
natural-spike language model (``tests/data/lm_spikes_gpu_norms.npz``, three
seeds of 2000 steps measured on one H200) through a setting and adam's second
moment (b2 0.999), and compares sqrt(v̂) from step 100 on with that of the
stream bounded at 2x its running median. The recommended setting and
``skip_on_spike`` around it stay within 1.25x on every seed; the unclipped run
and the former recommendation (no ceiling, a warm-up that only observes) do
not. A synthetic start of a run (norm 15 falling to 0.5, a x30 spike at step
16) checks that every step of the recommended setting leaves at most its
ceiling.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tests.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import replay

import clipjax


@pytest.fixture(scope="module")
def results() -> dict[str, replay.Result]:
    names = [
        "none",
        "recommended",
        "skip_on_spike(recommended)",
        'zclip(feedback="clipped", max_grad_norm=None)',
        'autoclip(feedback="clipped")',
        'zscore_clip(feedback="clipped")',
        'hist_clip(feedback="clipped")',
        "zclip()",
    ]
    return replay.evaluate(names)


def test_the_recording_has_the_early_transient() -> None:
    norms, losses = replay.load()
    assert norms.shape == losses.shape == (3, 2000)
    assert (norms[:, 0] > 10).all()  # the initial transient
    assert (norms[:, 16] > 10).all()  # the early spike, on every seed
    assert (np.median(norms[:, 100:], axis=1) < 1).all()  # the level the run settles at


@pytest.mark.parametrize(
    "name",
    [
        "recommended",
        "skip_on_spike(recommended)",
        'autoclip(feedback="clipped")',
        'zscore_clip(feedback="clipped")',
        'hist_clip(feedback="clipped")',
        "zclip()",
    ],
)
def test_protects_the_run_from_its_first_step(results, name: str) -> None:
    r = results[name]
    assert (r.worst <= replay.TARGET).all(), f"{name}: {r.worst}"
    assert (r.clipped_early > 0.1).all(), "the early transient must be clipped"


@pytest.mark.parametrize("name", ["none", 'zclip(feedback="clipped", max_grad_norm=None)'])
def test_without_a_ceiling_the_transient_stays_in_adams_second_moment(results, name) -> None:
    """A warm-up that only observes lets the start of the run through: from step
    100 on, sqrt(v̂) is several times the reference on every seed."""
    assert (results[name].worst > 3).all(), results[name].worst


def test_reference_bound() -> None:
    norms = np.array([[10.0] * 50 + [1.0] * 50 + [1.0, 5.0, 1.0]])
    bounded = replay.reference_bound(norms)
    assert (bounded[0, :50] == 2.0).all()  # the median of steps 50-99 is 1
    assert bounded[0, 101] == 2.0 and bounded[0, 100] == 1.0


def test_the_recommended_setting_bounds_every_step_of_a_synthetic_start() -> None:
    """Norm 15 falling to 0.5 over 20 steps, a x30 spike at step 16: every step of
    the first 25 leaves at most the ceiling the docs state (max_grad_norm=1.0),
    and the spike is reported as capped."""
    steps = np.arange(25)
    norms = np.maximum(15.0 * 0.85**steps, 0.5)
    norms[16] *= 30
    tx = replay.build(replay.recommended())
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    direction = np.array([1.0, 2.0, 2.0]) / 3.0
    for t, g in enumerate(norms):
        out, state = tx.update({"w": jnp.asarray(g * direction, jnp.float32)}, state, params)
        leaving = float(clipjax.global_norm(out))
        assert leaving <= 1.0 * (1 + 1e-5), (t, g, leaving)
        metrics = clipjax.metrics(state)
        capped = next(v for k, v in metrics.items() if k.endswith("/global/capped"))
        assert bool(capped) == (g > 1.0), (t, g)
