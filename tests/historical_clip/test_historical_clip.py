"""``clip_by_historical_norm`` against a float64 restatement of Levanter's code.

The restatement (``tests/restate/historical_clip.py``) follows stanford-crfm/levanter at
9263f81e8b453241332c2c0b2d2001bfb2d2241c, ``src/levanter/optim/clip_update_norm.py``;
``fix=True`` adds clipjax's documented change. Error budget: relative 3e-5 on the threshold,
the scale and the window's mean and std (measured below 3e-6); decisions and counters exact.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import references as R
from tests import restate as S
from tests.paths import ROOT
from tests.restate import historical_clip as L

N = 400
SPIKY = R.spikes(N, 7)[0]
DOWN = R.regime_shift(N, 8, 0.2)
WITH_NAN = R.with_nan(R.with_nan(SPIKY, [150]), [230], math.inf)
FIELDS = [*S.COMMON, "mean", "std"]


def prefix(group: str = "global") -> str:
    return f"clip_by_historical_norm/{group}/"


def run(norms: np.ndarray, **kwargs: Any) -> tuple:
    """``S.run_tree`` of ``clip_by_historical_norm(**kwargs)`` on one stream of norms."""
    return S.run_tree(clipjax.clip_by_historical_norm(**kwargs), norms[:, None])


@pytest.mark.parametrize("norms", ["spiky", "down"])
@pytest.mark.parametrize("settings", [{}, {"rolling_interval_length": 32, "sigma_factor": 2.0}])
def test_trace_equals_levanter(norms: str, settings: dict) -> None:
    seq = {"spiky": SPIKY, "down": DOWN}[norms]
    got, (outs, ins), _ = run(seq, **settings)
    want = L.historical_clip(seq, fix=False, **settings)
    S.compare(got, want, prefix(), FIELDS)
    np.testing.assert_allclose(outs["g0"] / ins["g0"], want["scale"], rtol=S.RTOL)
    if norms == "spiky":
        assert want["clipped"].sum() >= 3


def test_a_nan_norm_follows_the_fix() -> None:
    got, _, same = run(WITH_NAN)
    S.compare(got, L.historical_clip(WITH_NAN), prefix(), FIELDS)
    assert bool(np.asarray(same["g0"])[150]) and got[prefix() + "nonfinite_count"][-1] == 2


def test_fix_levanter_stops_clipping_while_a_nan_is_in_the_window() -> None:
    """**FIX**: Levanter's window takes the NaN, its threshold is NaN for 128 steps, and
    the x100 spike at step 187 passes unclipped."""
    norms = R.with_nan(SPIKY, [150])
    theirs = L.historical_clip(norms, fix=False)
    assert theirs["scale"][187] == 1.0 and np.isnan(theirs["threshold"][160:278]).all()
    assert run(norms)[0][prefix() + "scale"][187] < 0.05


@pytest.mark.parametrize("feedback", ["clipped", "skip"])
def test_other_feedbacks_equal_their_restatement(feedback: str) -> None:
    got = run(WITH_NAN, feedback=feedback)[0]
    S.compare(got, L.historical_clip(WITH_NAN, feedback=feedback), prefix(), FIELDS)


def test_per_param_and_per_layer_groups() -> None:
    streams = np.stack([SPIKY, DOWN, 0.5 * R.spikes(N, 9)[0]], axis=1)
    tx = clipjax.clip_by_historical_norm(32, scope="per_param", min_history=8)
    got, _, _ = S.run_tree(tx, streams)
    for j in range(3):
        want = L.historical_clip(streams[:, j], rolling_interval_length=32, min_history=8)
        S.compare(got, want, prefix(f"g{j}"), FIELDS)
    tx = clipjax.clip_by_historical_norm(32, scope="per_layer")
    got, _, _ = S.run_tree(tx, streams, S.layer_tree)
    S.compare(got, L.historical_clip(streams[:, 1], rolling_interval_length=32), prefix("l1"),
              FIELDS)  # fmt: skip


@pytest.mark.parametrize("length", [1, 2, 3])
def test_short_windows_take_levanters_default_min_history(length: int) -> None:
    """Levanter's count, at most the window's length, must reach max(2, length // 2): a
    window of 1 never clips (0.4's default min(max(2, length // 2), length) clipped)."""
    seq = SPIKY[:120]
    got, _, _ = run(seq, rolling_interval_length=length)
    want = L.historical_clip(seq, rolling_interval_length=length, fix=False)
    S.compare(got, want, prefix(), FIELDS)
    clipped = got[prefix() + "clipped"]
    assert (not clipped.any()) if length == 1 else clipped.any()


def test_raw_feedback_lets_the_second_spike_through() -> None:
    """Levanter's raw window keeps a spike of norm 3000 (norms near 0.3): the threshold
    reads 816 for 128 steps and a spike of 30 ten steps later passes whole; under
    feedback="clipped" the threshold stays near 0.4 and clips it (docs/defences.md)."""
    norms = 0.3 * np.exp(0.1 * np.random.default_rng(0).standard_normal(300))
    norms[150], norms[160] = 3000.0, 30.0
    raw, (outs, ins), _ = run(norms)
    threshold, scale = raw[prefix() + "threshold"], outs["g0"] / ins["g0"]
    assert scale[150] < 2e-4 and scale[160] == 1.0  # the first caught, the second whole
    np.testing.assert_allclose(threshold[151:279], 816.0, rtol=1e-3)
    assert threshold[279] < 10  # the spike has left the window
    clipped, (outs, ins), _ = run(norms, feedback="clipped")
    assert clipped[prefix() + "threshold"][151:].max() < 0.41
    np.testing.assert_allclose(outs["g0"][160] / ins["g0"][160], 0.397 / 30.0, rtol=1e-2)
    # The page and the docstring say what the default costs, with these figures.
    page = " ".join((ROOT / "docs" / "defences.md").read_text().split())
    assert f"the threshold reads {threshold[151]:.0f} for the next 128 steps" in page
    assert "a second spike of norm 30 ten steps later passes whole" in page
    doc = " ".join((clipjax.clip_by_historical_norm.__doc__ or "").split())
    assert "passes whole" in doc and '``feedback="clipped"`` is one argument away' in doc


def test_negative_controls_are_far_over_the_budget() -> None:
    got = run(SPIKY)[0]
    for kw in ({"rolling_interval_length": 100}, {"sigma_factor": 2.5}):
        want = L.historical_clip(SPIKY, fix=False, **kw)
        ok = np.isfinite(want["threshold"]) & np.isfinite(got[prefix() + "threshold"])
        error = np.max(np.abs(got[prefix() + "threshold"][ok] / want["threshold"][ok] - 1))
        assert error > 100 * S.RTOL, kw


def levanter_chain(clip: optax.GradientTransformation) -> optax.GradientTransformation:
    """Levanter's AdamConfig (``src/levanter/optim/config.py``): global clip, adam's
    moments, weight decay, the update clip, the learning rate."""
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(0.9, 0.95, 1e-8),
        optax.add_decayed_weights(0.1),
        clip,
        optax.scale(-3e-3),
    )


class RestatedClip:
    """The restated clip as an optax transform run eagerly on the norms seen so far."""

    def __init__(self, **kwargs: Any) -> None:
        self.norms: list[float] = []
        self.scales: list[float] = []
        self.kwargs = kwargs

    def transform(self) -> optax.GradientTransformation:
        def update(updates: Any, state: Any, params: Any = None) -> Any:
            self.norms.append(float(optax.tree.norm(updates)))
            scale = float(L.historical_clip(self.norms, fix=False, **self.kwargs)["scale"][-1])
            self.scales.append(scale)
            return jax.tree.map(lambda u: u * np.float32(scale), updates), state

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_the_recipe_after_the_optimizer_equals_levanters_chain() -> None:
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), "b": jnp.zeros(4)}
    grads = []
    for t in range(160):
        g = {k: 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        if t in (90, 130):  # Adam bounds each element's step, a spike of every one shows
            g = {k: np.full_like(v, 30.0) for k, v in g.items()}
        grads.append(g)
    kwargs = {"rolling_interval_length": 32}
    restated = RestatedClip(**kwargs)
    ours_tx = levanter_chain(clipjax.clip_by_historical_norm(**kwargs))
    theirs_tx = levanter_chain(restated.transform())
    ours, theirs = params, params
    ours_state, theirs_state = ours_tx.init(params), theirs_tx.init(params)
    update = jax.jit(ours_tx.update)
    for g in grads:
        u, ours_state = update(g, ours_state, ours)
        ours = optax.apply_updates(ours, u)
        u, theirs_state = theirs_tx.update(g, theirs_state, theirs)
        theirs = optax.apply_updates(theirs, u)
    assert min(restated.scales) < 0.8  # the clip acted on the update (x1.6 its history)
    for k in params:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
    m = clipjax.metrics(ours_state)
    assert int(m[prefix() + "clipped_count"]) == sum(s < 1 for s in restated.scales)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"rolling_interval_length": 0}, "rolling_interval_length"),
        ({"rolling_interval_length": 8.0}, "rolling_interval_length"),
        ({"sigma_factor": 0.0}, "sigma_factor"),
        ({"min_history": 0}, "min_history"),
        ({"rolling_interval_length": 8, "min_history": 9}, "min_history"),
        ({"feedback": "observe_first"}, "feedback"),
        ({"scope": "per_leaf"}, "scope"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        clipjax.clip_by_historical_norm(**kwargs)


def test_inject_hyperparams() -> None:
    tx = optax.inject_hyperparams(
        clipjax.clip_by_historical_norm, static_args=("rolling_interval_length",)
    )(rolling_interval_length=8, sigma_factor=2.0, min_history=4)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    for g in (1.0, 1.1, 0.9, 1.0, 30.0):
        out, state = jax.jit(tx.update)({"w": jnp.full(3, g)}, state, params)
    assert float(jnp.linalg.norm(out["w"])) < 3.0
