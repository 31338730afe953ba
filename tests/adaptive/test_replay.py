"""The start of a run at any gradient scale, on recorded norms: ``benchmarks/replay.py``
replays the natural-spike language model's unclipped norms (three seeds of 2000 steps on
one H200), times k in {0.01, 0.1, 1, 10, 100}, through a setting and adam's second moment
(b2 0.999), and compares sqrt(v̂) from step 100 on with that of the stream bounded at 2x
its running median. The recommended setting (and skip_on_spike around it) stays within
1.25x at every k, changing the same share of steps; no ceiling and 0.3's absolute one do not.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import replay

import clipjax

ABSOLUTE = 'zclip(feedback="clipped", max_grad_norm=1.0)'
NONE = 'zclip(feedback="clipped", max_grad_norm=None, relative_ceiling=None)'


@pytest.fixture(scope="module")
def results() -> dict[str, dict[float, replay.Result]]:
    return replay.evaluate(["none", "recommended", "skip_on_spike(recommended)", ABSOLUTE, NONE])


def test_the_recording_has_the_early_transient() -> None:
    norms, losses = replay.load()
    assert norms.shape == losses.shape == (3, 2000)
    assert (norms[:, 0] > 10).all()  # the initial transient
    assert (norms[:, 16] > 10).all()  # the early spike, on every seed
    assert (np.median(norms[:, 100:], axis=1) < 1).all()  # the level the run settles at


@pytest.mark.parametrize("name", ["recommended", "skip_on_spike(recommended)"])
def test_the_same_protection_at_every_scale(results, name: str) -> None:
    by_scale = results[name]
    assert set(by_scale) == set(replay.SCALES)
    for k, r in by_scale.items():
        assert (r.worst <= replay.TARGET).all(), f"{name} at k={k}: {r.worst}"
        assert (np.abs(r.changed - by_scale[1.0].changed) <= replay.MAX_SHIFT).all(), (k, r.changed)
    assert replay.same_at_every_scale(by_scale)


def test_an_absolute_ceiling_protects_at_one_scale_only(results) -> None:
    """0.3's recommendation: at k = 1 it protects; at k = 0.1 the transient stays in
    adam's second moment, at k = 10 it changes every step (a static clip)."""
    by_scale = results[ABSOLUTE]
    assert (by_scale[1.0].worst <= replay.TARGET).all()
    assert (by_scale[0.1].worst > 2).all() and (by_scale[0.01].worst > 3).all()
    assert (by_scale[10.0].changed > 0.99).all()
    assert not replay.same_at_every_scale(by_scale)


@pytest.mark.parametrize("name", ["none", NONE])
def test_without_a_ceiling_the_transient_stays_in_adams_second_moment(results, name) -> None:
    """A warm-up that only observes lets the start of the run through: from step
    100 on, sqrt(v̂) is several times the reference on every seed, at every k."""
    for r in results[name].values():
        assert (r.worst > 3).all(), r.worst


def test_reference_bound() -> None:
    norms = np.array([[10.0] * 50 + [1.0] * 50 + [1.0, 5.0, 1.0]])
    bounded = replay.reference_bound(norms)
    assert (bounded[0, :50] == 2.0).all()  # the median of steps 50-99 is 1
    assert bounded[0, 101] == 2.0 and bounded[0, 100] == 1.0


def test_the_recommended_setting_holds_every_step_of_a_synthetic_start() -> None:
    """Norm 15 falling to 0.5 over 20 steps, a x30 spike at step 16: every one of the
    first 25 steps is held, so clipjax.chain keeps it from adam (whose count stays
    0); alone, the clipper zeroes step 0 and leaves each later one at most the smaller
    of its norm and 1.5x the smallest norm before it (what optax.chain passes on),
    and the spike is reported as capped."""
    steps = np.arange(25)
    norms = np.maximum(15.0 * 0.85**steps, 0.5)
    norms[16] *= 30
    clipper = replay.build(replay.recommended())
    chained = clipjax.chain(replay.build(replay.recommended()), clipjax.adam(1e-3))
    params = {"w": jnp.zeros(3)}
    state, chain_state = clipper.init(params), chained.init(params)
    direction = np.array([1.0, 2.0, 2.0]) / 3.0
    for t, g in enumerate(norms):
        grads = {"w": jnp.asarray(g * direction, jnp.float32)}
        out, state = clipper.update(grads, state, params)
        leaving = float(clipjax.global_norm(out))
        bound = min(g, 1.5 * norms[:t].min()) if t else 0.0
        assert leaving <= bound * (1 + 1e-5), (t, g, leaving)
        m = clipjax.metrics(state)
        assert bool(m["zclip/global/held"]), t
        assert bool(m["zclip/global/capped"]) == (t > 0 and g > 1.5 * norms[:t].min()), (t, g)
        chain_out, chain_state = chained.update(grads, chain_state, params)
        assert float(clipjax.global_norm(chain_out)) == 0.0, t
    adam = optax.tree_utils.tree_get(chain_state, "ScaleByAdamState")
    assert int(adam.count) == 0
