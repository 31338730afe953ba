"""zclip(feedback="clipped"): a relative ceiling and a held start, no absolute number: the
same run at any gradient scale, against adam and the float64 restatement; what the
relative ceiling bounds and learns; the ``headroom`` of an absolute ceiling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import drive
from tests import restate as S

RNG = np.random.default_rng(7)
STEPS = 300
# An initial transient (x20 falling to the level), a lasting x3 rise at 150,
# spikes, a zero norm and non-finite norms.
NORMS = 0.5 * np.exp(0.2 * RNG.standard_normal(STEPS))
NORMS[:12] *= np.geomspace(20, 1.5, 12)
NORMS[[40, 90, 230]] *= 30
NORMS[150:] *= 3
NORMS[60] = 0.0
NORMS[[8, 70]] = [np.nan, np.inf]


SETTINGS = {
    "default": {},
    "relative_ceiling": {"relative_ceiling": 3.0, "ceiling_window": 10},
    "warmup_steps": {"warmup_steps": 5},
    "weight": {"start": "weight"},
    "no_start": {"start": None},
    "hold_capped": {"start": "hold", "max_grad_norm": 2.0},
}


@pytest.mark.parametrize("config", list(SETTINGS))
def test_settings_match_the_restatement(config: str) -> None:
    kw = SETTINGS[config]
    want = S.zclip(NORMS, feedback="clipped", **kw)
    S.compare(drive.run(clipjax.zclip(feedback="clipped", **kw), NORMS), want, "")
    if config == "default":
        assert want["scale"][0] == 0 and want["held"][0]
        # The first 25 finite steps are held, none after.
        held_at = np.flatnonzero(want["held"])
        assert len(held_at) == 25 and np.isfinite(NORMS[held_at]).all() and held_at[-1] < 27


def _updates(tx: optax.GradientTransformation, grads: np.ndarray) -> np.ndarray:
    params = {"w": jnp.zeros(grads.shape[1:])}

    def step(state, g):
        updates, state = tx.update({"w": g}, state, params)
        return state, updates["w"]

    return np.asarray(jax.lax.scan(step, tx.init(params), jnp.asarray(grads))[1])


def _gradients() -> np.ndarray:
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((STEPS, 8, 4)) * np.exp(0.3 * rng.standard_normal((STEPS, 1, 1)))
    grads[:10] *= 20  # the initial transient
    grads[[120, 200]] *= 50  # spikes
    grads[250:] *= 4  # a lasting rise
    return grads.astype(np.float32)


@pytest.mark.parametrize("k", [0.01, 100.0])
@pytest.mark.parametrize(
    "route", ["clipjax.chain", "skip_on_spike", "optax.chain"], ids=lambda r: r
)
def test_a_loss_times_k_is_the_same_run(k: float, route: str) -> None:
    """With adam's eps at 0 the updates agree to float32 rounding; with its default
    1e-8 (the only absolute number left) to 1e-4 at k = 0.01, where the first steps'
    weighted elements are ~1e-4 and eps is 1e-4 of them."""
    grads = _gradients()
    # Through optax.chain adam sees the zeroed first step, which eps = 0 makes 0 / 0.
    cases = ((0.0, 2e-5), (1e-8, 1e-4)) if route != "optax.chain" else ((1e-8, 1e-4),)
    for eps, rtol in cases:

        def make(eps: float = eps) -> optax.GradientTransformation:
            clipper = clipjax.zclip(feedback="clipped")
            if route == "optax.chain":
                return optax.chain(clipper, optax.adam(1e-3, eps=eps))
            inner = clipjax.chain(clipper, clipjax.adam(1e-3, eps=eps))
            return clipjax.skip_on_spike(inner) if route == "skip_on_spike" else inner

        base = _updates(make(), grads)
        scaled = _updates(make(), grads * np.float32(k))
        np.testing.assert_allclose(scaled, base, rtol=rtol, atol=rtol * np.abs(base).max())
    # adam alone at k = 1 and no clipping: the control, which differs.
    alone = _updates(optax.adam(1e-3, eps=0.0), grads)
    assert np.abs(alone - base).max() > 0.1 * np.abs(base).max()


def test_an_absolute_ceiling_is_not_the_same_run() -> None:
    """The negative control: 0.3's setting, zclip(feedback="clipped", max_grad_norm=1.0)."""
    grads = _gradients()
    make = lambda: optax.chain(
        clipjax.zclip(feedback="clipped", max_grad_norm=1.0), optax.adam(1e-3, eps=0.0)
    )
    base, scaled = _updates(make(), grads), _updates(make(), grads * np.float32(0.01))
    assert np.abs(scaled - base).max() > 0.1 * np.abs(base).max()


@pytest.mark.parametrize("start", ["auto", "weight"])
def test_step_zero(start: str) -> None:
    """No norm bounds the first step: held (zeroed where it still reaches an optimizer);
    0.4's start weighs it by time (1/25)."""
    tx = clipjax.zclip(feedback="clipped", start=start)
    g = {"w": jnp.full(4, 300.0)}
    out, state = tx.update(g, tx.init(g))
    m = {k.split("/")[-1]: v for k, v in clipjax.metrics(state).items()}
    if start == "weight":
        np.testing.assert_allclose(out["w"], g["w"] / 25, rtol=1e-6)
        assert float(m["weight"]) == pytest.approx(0.04) and "held" not in m
        return
    np.testing.assert_array_equal(out["w"], np.zeros(4))
    assert bool(m["held"]) and float(m["scale"]) == 0 and float(m["clip_to"]) == 0
    assert bool(m["clipped"]) and not bool(m["capped"])


def test_a_short_rise_is_bounded_and_a_lasting_one_learnt() -> None:
    """x10 for 30 steps (under half the window of 100) never leaves above 1.5 x the
    median before it; x10 for good is bounded for about half a window, then learnt."""
    noise = np.exp(0.05 * np.random.default_rng(3).standard_normal(630))
    norms = np.concatenate([np.ones(200), np.full(30, 10.0), np.ones(100), np.full(300, 10.0)])
    norms = norms * noise
    got = drive.run(clipjax.zclip(feedback="clipped"), norms)
    out = got["applied"] * norms
    bound = 1.5 * np.median(norms[100:200]) * (1 + 1e-5)
    assert (out[200:230] <= bound).all() and (out[330:375] <= 1.1 * bound).all()
    assert (got["applied"][400:] < 1).mean() < 0.1  # the new level is learnt


def test_a_zero_norm_carries_no_scale() -> None:
    """A group whose norm is once 0 (a frozen layer's first step) is not capped at 0:
    the first positive norm is the one no norm bounds (held, zeroed), the rest pass."""
    norms = np.array([0.0, 1.0, 1.1, 0.9, 1.0, 0.0, 1.0])
    got = drive.run(clipjax.zclip(feedback="clipped", warmup_steps=3), norms)
    assert got["applied"][1] == 0 and (got["applied"][2:] > 0.3).all()
    got = drive.run(clipjax.zclip(feedback="clipped", warmup_steps=3, start="weight"), norms)
    assert (got["applied"][1:] > 0.3).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"relative_ceiling": 1.0}, "relative_ceiling must be > 1"),
     ({"relative_ceiling": "x"}, "relative_ceiling must be"),
     ({"ceiling_window": 0}, "ceiling_window"), ({"max_grad_norm": "x"}, "max_grad_norm must be")],
)  # fmt: skip
def test_bad_ceilings_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        clipjax.zclip(feedback="clipped", **kwargs)


def test_an_absolute_ceiling_replaces_the_relative_one() -> None:
    """0.3's recommendation, one argument away: no window, no weight."""
    state = clipjax.zclip(feedback="clipped", max_grad_norm=1.0).init({"w": jnp.zeros(3)})
    assert state.window is None and state.low is None
    assert "weight" not in state.metrics and "headroom" in state.metrics
    reference = clipjax.zclip().init({"w": jnp.zeros(3)})
    assert reference.window is None and "weight" not in reference.metrics


@pytest.mark.parametrize(
    "make",
    [
        lambda: clipjax.zclip(),
        lambda: clipjax.zclip(feedback="clipped", max_grad_norm=1.0),
        lambda: clipjax.autoclip(feedback="clipped"),
        lambda: clipjax.autoclip(mode="percentile", percentile=90, max_grad_norm=1.0),
        lambda: clipjax.zscore_clip(feedback="clipped"),
        lambda: clipjax.hist_clip(feedback="clipped"),
    ],
    ids=["zclip", "zclip_clipped_cap", "autoclip", "autoclip_percentile", "zscore", "hist"],
)
def test_headroom_shows_a_ceiling_that_is_wrong_for_the_run(make) -> None:
    """An absolute ceiling over the clipper's level: ~100 for norms of 0.01 (it bounds
    nothing), below 1 for norms of 10 (it binds on every step)."""
    for level, low, high in ((0.01, 50, 200), (10.0, 0.05, 0.2)):
        norms = level * np.exp(0.1 * np.random.default_rng(1).standard_normal(60))
        got = drive.run(make(), norms)
        headroom = got["headroom"]
        assert low < headroom[-1] < high, (level, headroom[-5:])
        assert np.isfinite(headroom).all()
