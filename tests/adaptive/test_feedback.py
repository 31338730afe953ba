"""``feedback``: every adaptive clipper against its float64 restatement (``tests/restate/``).

Tolerance: rtol 3e-5 (float32 against float64) on every float field; ``z`` also an
absolute 5e-5 (``restate.Z_ATOL``); counters and ``clipped`` exactly.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import references as R
from tests import restate as S

N = 300
# spikes x10, x100, x1000, x30 at steps 90, 140, 190, 240; a NaN inside every
# warm-up (step 10) and one after it (step 130), and an +inf at 200.
NORMS = R.with_nan(R.with_nan(R.spikes(N, 0)[0], [10, 130]), 200, math.inf)
SPIKES = (90, 140, 190, 240)

AUTO_KW = dict(warmup_steps=30, min_history=20)
ZSCORE_KW = dict(warmup_steps=30, min_history=20)
ZCLIP_KW = dict(warmup_steps=25, max_grad_norm=None)


def _hist_tx(criterion: str = "zstat", **kw):
    crit = clipjax.zstat_criterion() if criterion == "zstat" else clipjax.ema_criterion()
    return clipjax.hist_clip(crit, warmup_clip=None, **kw)


_AUTO = ("autoclip", clipjax.autoclip, S.autoclip)
_ZCLIP = ("zclip", clipjax.zclip, S.zclip)
_PCT = dict(mode="percentile", **AUTO_KW)
# name -> (algo prefix, clipjax factory, restatement, kwargs, restatement's extra kwargs)
CONFIGS = {
    "autoclip_auto": (*_AUTO, AUTO_KW, {}),
    "autoclip_window": (*_AUTO, dict(history="window", window_size=50, **_PCT), {}),
    "autoclip_geometric": (*_AUTO, dict(history="geometric", quantile_lr=0.05, **_PCT), {}),
    "zscore_clip": ("zscore_clip", clipjax.zscore_clip, S.zscore_clip, ZSCORE_KW, {}),
    "zclip": (*_ZCLIP, ZCLIP_KW, {}),
    "zclip_cap": (*_ZCLIP, dict(ZCLIP_KW, max_grad_norm=20.0), {}),  # fires on the large spikes
    "zclip_percentile": (*_ZCLIP, dict(ZCLIP_KW, mode="percentile"), {}),
    "zclip_mean": (*_ZCLIP, dict(ZCLIP_KW, max_grad_norm=5.0, clip_option="mean"), {}),
    **{f"hist_{c}": ("hist_clip", partial(_hist_tx, c), S.hist_clip, dict(warmup_steps=20),
                     dict(criterion=c)) for c in ("zstat", "ema")},
}  # fmt: skip
DEFAULT = {"autoclip": "observe_first", "zscore_clip": "observe_first", "zclip": "clip_target",
           "hist_clip": "raw"}  # fmt: skip
_TARGET = ("raw", "clipped", "clip_target", "skip")
# Feedback values each configuration accepts (its default among them).
ACCEPTED = {
    "autoclip_auto": ("observe_first", "raw", "clipped", "skip"),
    "autoclip_window": ("observe_first", "raw", "clipped"),
    "autoclip_geometric": ("observe_first", "raw", "clipped"),
    "zscore_clip": ("observe_first", "raw", "clipped", "skip"),
    **{c: _TARGET for c in CONFIGS if c.startswith(("zclip", "hist"))},
}


def _make(config, feedback=None, **extra):
    _, factory, _, kw, _ = CONFIGS[config]
    return factory(**kw, **({} if feedback is None else {"feedback": feedback}), **extra)


def _want(config, norms, feedback=None):
    algo, _, restated, kw, rkw = CONFIGS[config]
    return restated(norms, **kw, **rkw, feedback=DEFAULT[algo] if feedback is None else feedback)


def _check_rec(rec, want, prefix, what=""):
    """Metrics, applied scale (every leaf) and pass-through of non-finite steps."""
    got, outs, ins, same = rec
    try:
        S.compare(got, want, prefix)
        finite = np.isfinite(want["grad_norm"])
        for o, i, sm in zip(jax.tree.leaves(outs), jax.tree.leaves(ins), jax.tree.leaves(same)):
            np.testing.assert_allclose(o[finite] / i[finite], want["scale"][finite], rtol=S.RTOL)
            assert np.all(sm[~finite]), "a non-finite step must pass unchanged"
    except AssertionError as e:
        raise AssertionError(f"[{what}] {e}") from None


def test_incremental_p2_is_the_shared_restatement():
    for seed in range(3):
        x = np.random.default_rng(seed).lognormal(0, 0.5, 400)
        p2, got = S.P2Median(), []
        for v in x:
            p2.observe(float(v))
            got.append(p2.value())
        np.testing.assert_array_equal(got, S.p2_restated(x, 0.5, textbook=True))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_feedback_matches_restatement(config):
    """Every accepted feedback and the default, in one scan (scope="global"): each equals
    the restatement, and the default equals its explicit value bit for bit."""
    algo = CONFIGS[config][0]
    fbs = ACCEPTED[config]
    txs = [_make(config, fb) for fb in fbs] + [_make(config)]
    recs = S.run_trees(txs, NORMS[:, None], [S.flat_tree] * len(txs))
    for fb, rec in zip((*fbs, None), recs):
        _check_rec(rec, _want(config, NORMS, fb), f"{algo}/global/", f"{config} feedback={fb}")
        if fb == "skip":  # every spike fires and is not counted
            count = rec[0][f"{algo}/global/count"]
            assert all(count[t] == count[t - 1] for t in SPIKES), count[list(SPIKES)]
    explicit = fbs.index(DEFAULT[algo])
    for k, v in recs[-1][0].items():
        np.testing.assert_array_equal(v, recs[explicit][0][k], err_msg=f"default vs explicit: {k}")


@pytest.mark.parametrize("feedback", ["raw", "clipped"])
def test_ema_percentile_judge_first_is_observe_first_shifted(feedback):
    """history="ema" (no restatement): percentile mode observes g under "raw" and
    "clipped", so its statistics are observe-first's and the threshold of step t is the
    observe-first quantile of step t-1 (floored at eps), used once count-before >= gate."""
    kw = dict(mode="percentile", history="ema", ema_decay=0.95, **AUTO_KW)
    eps, p = 1e-8, "autoclip/global/"
    base, _, _ = S.run_tree(clipjax.autoclip(**kw), NORMS[:, None])
    tx = clipjax.autoclip(**kw, feedback=feedback, max_grad_norm=None)  # no ceiling
    got, _, _ = S.run_tree(tx, NORMS[:, None])
    np.testing.assert_allclose(got[p + "quantile"], base[p + "quantile"], rtol=S.RTOL)
    np.testing.assert_array_equal(got[p + "count"], base[p + "count"])
    q_prev = np.concatenate([[np.nan], base[p + "quantile"][:-1]])
    count_before = np.concatenate([[0], base[p + "count"][:-1]])
    finite = np.isfinite(NORMS)
    check = finite & (count_before >= 1)
    np.testing.assert_allclose(
        got[p + "threshold"][check], np.maximum(eps, q_prev[check]), rtol=S.RTOL
    )
    open_ = finite & (count_before >= max(AUTO_KW.values()))
    scale = np.where(open_, np.minimum(1.0, np.maximum(eps, q_prev) / (NORMS + eps)), 1.0)
    np.testing.assert_allclose(got[p + "scale"][finite], scale[finite], rtol=S.RTOL)
    assert np.all(got[p + "scale"][~finite] == 1.0)
    assert np.all(got[p + "scale"][list(SPIKES)] < 0.2)  # cut to the quantile before them


STREAMS3 = np.stack(
    [
        R.with_nan(R.spikes(N, 1)[0], [5, 150]),
        0.1 * R.with_nan(R.spikes(N, 2, at=[100, 170, 210, 260])[0], [120]),
        10.0 * R.with_nan(R.spikes(N, 3, at=[95, 135, 180, 280])[0], [60, 61]),
    ],
    axis=1,
)
SCOPE_CASES = {
    "defaults": [("autoclip_auto", None), ("zclip", None), ("hist_zstat", None)],
    "feedback": [("autoclip_auto", "clipped"), ("zscore_clip", "skip"),
                 ("zclip_percentile", "skip"), ("hist_zstat", "clipped"), ("hist_ema", "skip")],
    # "clipped" observes min(g, B), "clip_target" the reference's clip target, per group, with a cap
    "boundary": [("zclip", "clipped"), ("zclip_cap", "clipped"), ("zclip_cap", "clip_target"),
                 ("zclip_percentile", "clipped"), ("hist_zstat", "clip_target"),
                 ("hist_ema", "clipped")],
}  # fmt: skip


@pytest.mark.parametrize("scope", ["per_param", "per_layer"])
@pytest.mark.parametrize("cases", sorted(SCOPE_CASES))
def test_scopes_match_per_group_restatement(cases, scope):
    """3 groups with different streams (scales 1, 0.1, 10; NaNs at different steps):
    each equals the single-group restatement on its own stream."""
    make_tree = S.flat_tree if scope == "per_param" else S.layer_tree
    names = ["g0", "g1", "g2"] if scope == "per_param" else ["l0", "l1", "l2"]
    cases = SCOPE_CASES[cases]
    txs = [_make(c, fb, scope=scope) for c, fb in cases]
    recs = S.run_trees(txs, STREAMS3, [make_tree] * len(txs))
    for (config, fb), (got, outs, ins, same) in zip(cases, recs):
        for i, name in enumerate(names):
            sub = (got, {"x": outs[name]}, {"x": ins[name]}, {"x": same[name]})
            what = f"{config} feedback={fb} {scope} {name}"
            algo = CONFIGS[config][0]
            _check_rec(sub, _want(config, STREAMS3[:, i], fb), f"{algo}/{name}/", what)


REPLICA_FACTORS = np.array([0.5, 1.0, 1.8])
AXIS_CASES = [("zclip", None), ("autoclip_auto", "raw"), ("zscore_clip", "clipped"),
              ("hist_zstat", "skip")]  # fmt: skip


@pytest.mark.parametrize("config, feedback", AXIS_CASES)
def test_axis_name_every_replica_sees_the_averaged_norm(config, feedback):
    tx = _make(config, feedback, axis_name="i")
    reps = len(REPLICA_FACTORS)
    local = NORMS[:, None] * REPLICA_FACTORS[None, :]  # [steps, replicas]
    params = S.flat_tree(jnp.ones(1))
    state0 = jax.tree.map(lambda a: jnp.broadcast_to(a, (reps, *a.shape)), tx.init(params))

    def step(state, row):
        grads = jax.vmap(S.flat_tree)(row[:, None])
        upd = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="i")
        out, state = upd(grads, state)
        applied = jnp.linalg.norm(out["g0"], axis=1) / jnp.linalg.norm(grads["g0"], axis=1)
        return state, (clipjax.metrics(state), applied)

    run = jax.jit(lambda seq: jax.lax.scan(step, state0, seq)[1])
    metrics, applied = run(jnp.asarray(local, jnp.float32))
    w = _want(config, local.mean(axis=1), feedback)
    finite = np.isfinite(w["grad_norm"])
    for r in range(reps):
        got = {k: np.asarray(v)[:, r] for k, v in metrics.items()}
        S.compare(got, w, f"{CONFIGS[config][0]}/global/")
        np.testing.assert_allclose(np.asarray(applied)[finite, r], w["scale"][finite], rtol=S.RTOL)


INJECT = {
    "zclip-clipped": ("zclip", dict(z_thresh=2.0, warmup_steps=25, max_grad_norm=None)),
    "zscore_clip-raw": ("zscore_clip", dict(zmax=2.5, **ZSCORE_KW)),
    "zscore_clip-skip": ("zscore_clip", dict(zmax=2.5, **ZSCORE_KW)),
}


@pytest.mark.parametrize("case", list(INJECT))
def test_inject_hyperparams_feedback(case):
    name, kw = INJECT[case]
    feedback = case.split("-")[1]
    injected = optax.inject_hyperparams(getattr(clipjax, name), static_args=("warmup_steps",))
    want = getattr(S, name)(NORMS, **kw, feedback=feedback)
    S.check_run(injected(**kw, feedback=feedback), NORMS, want, f"{name}/global/")


# The level the statistics set after a step (post-update): what the next step is judged by.
LEVEL = {
    "autoclip": lambda m, p: m[p + "median"] + 3.0 * m[p + "std"],
    "zscore_clip": lambda m, p: m[p + "mean"] + 3.0 * m[p + "std"],
    "zclip": lambda m, p: m[p + "mean"] + 2.5 * m[p + "std"],
    "hist_clip": lambda m, p: m[p + "mean"] + 2.5 * m[p + "std"],
}


@pytest.mark.parametrize("config", ["autoclip_auto", "zscore_clip", "zclip", "hist_zstat"])
def test_spike_moves_threshold_no_more_than_its_clip_value(config):
    """With the x1000 spike replaced by its clip value (its threshold), "clipped" leaves
    the statistics of the replaced stream; "skip" does not move them; "raw" moves them
    much more."""
    algo = CONFIGS[config][0]
    # No ceiling (zclip's configurations already say max_grad_norm=None).
    extra = {} if algo == "zclip" else {"max_grad_norm": None}
    make = lambda fb: _make(config, fb, **extra)
    t, norms, key, level = SPIKES[2], R.spikes(N, 0)[0], f"{algo}/global/", LEVEL[algo]
    a = S.run_trees([make("clipped"), make("skip"), make("raw")], norms[:, None], [S.flat_tree] * 3)
    clipped, skipped, raw = (r[0] for r in a)
    assert clipped[key + "clipped"][t] and skipped[key + "clipped"][t]
    replaced = norms.copy()
    replaced[t] = clipped[key + "threshold"][t]
    ((ref_c, *_),) = S.run_trees([make("clipped")], replaced[:, None], [S.flat_tree])
    np.testing.assert_allclose(level(clipped, key)[t], level(ref_c, key)[t], rtol=1e-4)
    # skip: the spike does not move the statistics at all (observing its clip value
    # may move them a little either way: zclip's variance shrinks when it observes
    # a value close to its mean, so "no higher than the replaced run" is not a law)
    for f in ("median", "mean", "std", "count"):
        if key + f in skipped:
            assert skipped[key + f][t] == skipped[key + f][t - 1], f
    assert level(raw, key)[t] > 2 * level(clipped, key)[t]


def test_zclip_skip_update_on_spike_is_feedback_skip():
    run = lambda **kw: S.run_tree(clipjax.zclip(**kw, **ZCLIP_KW), NORMS[:, None])[0]
    a, b = run(skip_update_on_spike=True), run(feedback="skip")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    S.compare(a, S.zclip(NORMS, feedback="skip", **ZCLIP_KW), "zclip/global/")
    with pytest.raises(ValueError, match=r"feedback|skip_update_on_spike"):
        clipjax.zclip(skip_update_on_spike=True, feedback="raw")


INVALID = [
    *[("autoclip", dict(mode="percentile", history=h), "skip")
      for h in ("window", "ema", "geometric")],
    *[(f, {}, "observe_first") for f in ("zclip", "hist_clip", "adagc")],
    ("autoclip", {}, "bogus"), ("autoclip", dict(mode="percentile"), "bogus"),
    *[(f, {}, "bogus") for f in ("zscore_clip", "zclip", "hist_clip", "adagc")],
    *[(f, {}, "clip_target") for f in ("autoclip", "zscore_clip", "adagc")],
]  # fmt: skip


@pytest.mark.parametrize(
    "factory, kw, feedback", INVALID, ids=[f"{f}-{v}-{i}" for i, (f, _, v) in enumerate(INVALID)]
)
def test_invalid_feedback_raises(factory, kw, feedback):
    with pytest.raises(ValueError, match="feedback"):
        getattr(clipjax, factory)(**kw, feedback=feedback)
