"""autoclip(history="window") in auto mode against its restatement and following a shift;
the threshold before the first observation; the gate's defaults; bad values."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest

import clipjax
from tests import references as R
from tests import restate as S

N = 300
NORMS = R.with_nan(R.with_nan(R.spikes(N, 0)[0], [10, 130]), 200, math.inf)
GATE = dict(warmup_steps=30, min_history=20)


def _metrics(tx, norms):
    return S.run_tree(tx, np.asarray(norms, np.float64)[:, None])[0]


@pytest.mark.parametrize("feedback", ["observe_first", "raw", "clipped", "skip"])
# (window_size=1 under observe_first has T == g: clipped in float64 by the eps
# in T / (g + eps), not in float32; that edge is not what is tested here.)
@pytest.mark.parametrize("window_size", [2, 16, 64])
def test_auto_window_matches_restatement(feedback, window_size):
    kw = dict(mode="auto", history="window", window_size=window_size, **GATE)
    tx = clipjax.autoclip(**kw, feedback=feedback)
    got = S.check_run(tx, NORMS, S.autoclip(NORMS, **kw, feedback=feedback), "autoclip/global/")
    if feedback == "clipped" and window_size == 64:
        # the x10 .. x1000 spikes of R.spikes (all after the gate) are all clipped
        at = [int(t) for t in R.spikes(N, 0)[1]]
        assert all(got["autoclip/global/clipped"][t] for t in at), at


def _shift(factor, before=200, after=200, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    base = np.exp(noise * rng.standard_normal(before + after))
    return base * np.r_[np.ones(before), np.full(after, factor)], before


def _first_within(values, level, since, rtol=0.2):
    """Steps after ``since`` until ``values`` is within ``rtol`` of ``level`` for good."""
    ok = np.abs(np.asarray(values[since:]) / level - 1) <= rtol
    bad = np.nonzero(~ok)[0]
    return 0 if bad.size == 0 else int(bad[-1]) + 1 if bad[-1] + 1 < ok.size else None


@pytest.mark.parametrize("factor", [0.2, 5.0])
def test_window_median_follows_a_noise_free_shift_in_half_a_window(factor):
    """Noise-free: the median is the new level once more than half the window
    holds it, i.e. exactly ``window_size // 2 + 1`` steps after the shift; the
    threshold ``median + 3 std`` once the whole window does (std 0)."""
    w = 40
    norms, at = _shift(factor)
    kw = dict(mode="auto", history="window", window_size=w, **GATE)
    want = S.autoclip(norms, **kw, feedback="raw")
    got = _metrics(clipjax.autoclip(**kw, feedback="raw"), norms)
    # Not ``clipped``: on a constant stream T == g, which T / (g + eps) clips in
    # float64 and not in float32.
    S.compare(got, want, "autoclip/global/", ["median", "std", "threshold", "count"])
    median = got["autoclip/global/median"]
    # median at step t is post-update: the (t - at + 1)-th new value is in.
    steps = _first_within(median, factor, at) + 1
    assert steps == w // 2 + 1
    threshold = got["autoclip/global/threshold"]  # judged before the step
    assert _first_within(threshold, factor, at, rtol=1e-6) == w
    # The whole-history statistics have not followed by then.
    full = S.autoclip(norms, mode="auto", history="all", **GATE, feedback="raw")
    assert abs(full["median"][at + w] / factor - 1) > 0.2


@pytest.mark.parametrize("feedback", ["raw", "clipped"])
@pytest.mark.parametrize("factor", [0.2, 5.0])
def test_window_follows_a_noisy_shift_as_restated(feedback, factor):
    """lognormal(0, 0.1) noise: the threshold is back within 20 % of the new
    level's own threshold after the number of steps the restatement predicts,
    and the whole-history statistics take several times longer (or never)."""
    w = 100
    norms, at = _shift(factor, before=300, after=500, noise=0.1, seed=3)
    # No ceiling: the window alone follows the shift.
    kw = dict(mode="auto", history="window", window_size=w, max_grad_norm=None, **GATE)
    want = S.autoclip(norms, **kw, feedback=feedback)
    got = S.check_run(clipjax.autoclip(**kw, feedback=feedback), norms, want, "autoclip/global/")
    # the new level's own threshold: median + 3 std of its stationary stream
    steady = np.median(norms[at:]) + 3 * np.std(norms[at:], ddof=1)
    predicted = _first_within(want["threshold"], steady, at)
    measured = _first_within(got["autoclip/global/threshold"], steady, at)
    assert predicted is not None and measured == predicted
    if feedback == "raw" or factor < 1:
        # the window is all new after w steps; its threshold then wobbles by
        # less than 20 % around the steady one
        assert predicted <= w
    else:
        # a rise fed back as T: each half window raises T by about 1 + 3 sd;
        # with sd ~ 0.1 that is log(5) / log(1.3) ~ 6 half-windows at most
        assert predicted <= 6 * w
    full = S.autoclip(
        norms, mode="auto", history="all", max_grad_norm=None, **GATE, feedback=feedback
    )
    slow = _first_within(full["threshold"], steady, at)
    assert slow is None or slow > 2 * predicted, (slow, predicted)


FIRST = np.array([math.nan, math.inf, 1.0, 2.0, 1.5])
# clipper -> (factory, kwargs)
KINDS = {
    "autoclip_all": ("autoclip", dict(history="all")),
    "autoclip_default": ("autoclip", {}),
    "autoclip_window": ("autoclip", dict(history="window")),
    "autoclip_percentile": ("autoclip", dict(mode="percentile")),
    "autoclip_ema": ("autoclip", dict(mode="percentile", history="ema")),
    "autoclip_geometric": ("autoclip", dict(mode="percentile", history="geometric")),
    "zscore_clip": ("zscore_clip", {}),
}


@pytest.mark.parametrize("feedback", ["raw", "clipped", "skip"])
@pytest.mark.parametrize("clipper", list(KINDS))
def test_judge_first_threshold_is_inf_before_first_observation(clipper, feedback):
    """Without a ceiling, a judge-first threshold is +inf before the first finite norm."""
    prefix, kw = KINDS[clipper]
    if feedback == "skip" and kw.get("mode") == "percentile":
        pytest.skip("percentile mode rejects feedback='skip'")
    tx = getattr(clipjax, prefix)(feedback=feedback, max_grad_norm=None, **kw)
    got = _metrics(tx, FIRST)
    threshold = got[f"{prefix}/global/threshold"]
    assert np.all(np.isposinf(threshold[:3])), threshold
    assert np.all(np.isfinite(threshold[3:])), threshold
    np.testing.assert_array_equal(got[f"{prefix}/global/scale"], 1.0)


def test_other_rules_threshold_before_the_first_observation():
    """Observe-first is finite on the first observation; clip-then-observe clippers
    report +inf through their warm-up."""
    got = _metrics(clipjax.zscore_clip(), FIRST)
    threshold = got["zscore_clip/global/threshold"]
    assert np.isfinite(threshold[2]) and threshold[2] == pytest.approx(1.0)
    got = _metrics(clipjax.zclip(max_grad_norm=None, warmup_steps=2), FIRST)
    assert np.all(np.isposinf(got["zclip/global/threshold"][:4]))
    got = _metrics(clipjax.hist_clip(warmup_steps=2, warmup_clip=None), FIRST)
    assert np.all(np.isposinf(got["hist_clip/global/threshold"][:4]))


@pytest.mark.parametrize("clipper", list(KINDS))
def test_the_ceiling_bounds_the_steps_before_the_first_observation(clipper):
    """feedback="clipped" with its default ceiling (max_grad_norm=1.0): the threshold
    before any observation is the ceiling, not +inf, and the norm 2.0 at step 3 (gate
    still closed) leaves at 1.0, reported as capped."""
    prefix, kw = KINDS[clipper]
    got = _metrics(getattr(clipjax, prefix)(feedback="clipped", **kw), FIRST)
    np.testing.assert_array_equal(got[f"{prefix}/global/threshold"], 1.0)
    np.testing.assert_array_equal(got[f"{prefix}/global/capped"], [0, 0, 0, 1, 1])
    np.testing.assert_allclose(got[f"{prefix}/global/scale"][3:], [1 / 2, 1 / 1.5], rtol=1e-5)


def _steady_then_spike(n_steady, seed=0):
    rng = np.random.default_rng(seed)
    return np.r_[np.exp(0.1 * rng.standard_normal(n_steady)), [50.0], np.ones(5)]


@pytest.mark.parametrize("factory", ["autoclip", "zscore_clip"])
@pytest.mark.parametrize("feedback", ["raw", "clipped", "skip"])
def test_judge_first_gate_defaults_to_ten(factory, feedback):
    # No ceiling: the gate alone decides (the ceiling bounds every step, gate or not).
    tx = partial(getattr(clipjax, factory), feedback=feedback, max_grad_norm=None)
    want = partial(getattr(S, factory), min_history=10, feedback=feedback, max_grad_norm=None)
    key = f"{factory}/global/clipped"
    norms = _steady_then_spike(10)  # the spike is the 11th norm: the gate is open
    got = S.check_run(tx(), norms, want(norms, warmup_steps=10), f"{factory}/global/")
    assert got[key][10] and not got[key][:10].any()
    # one fewer observation: the gate is still closed on the spike
    assert not _metrics(tx(), _steady_then_spike(9))[key][9]
    # a value set by hand wins; the other one keeps its default of 10
    norms = _steady_then_spike(20)
    got = S.check_run(
        tx(warmup_steps=30), norms, want(norms, warmup_steps=30), f"{factory}/global/"
    )
    assert not got[key].any()


@pytest.mark.parametrize("factory", ["autoclip", "zscore_clip"])
def test_observe_first_gate_keeps_smartclip_defaults(factory):
    norms = NORMS[:160]
    want = getattr(S, factory)(norms, warmup_steps=100, min_history=50)
    got = S.check_run(getattr(clipjax, factory)(), norms, want, f"{factory}/global/")
    clipped = got[f"{factory}/global/clipped"]
    assert not clipped[:99].any() and clipped[140]  # R.spikes' x100 spike at 140


@pytest.mark.parametrize(
    "kw, arg",
    [
        *[(dict(history=h), "history") for h in ("geometric", "ema", "bogus")],
        (dict(mode="percentile", history="all"), "history"),
        *[(dict(history="window", window_size=w), "window_size") for w in (0, 2.5)],
        (dict(feedback="clipped", warmup_steps=-1), "warmup_steps"),
        (dict(feedback="clipped", min_history=1.5), "min_history"),
    ],
)
def test_bad_values_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=arg):
        clipjax.autoclip(**kw)
