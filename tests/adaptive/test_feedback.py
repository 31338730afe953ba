"""``feedback``: every adaptive clipper against a float64 restatement.

The restatements live in ``tests/restate/`` and are written from SPEC 3, 4,
8, 9.1 and the 0.2 CONTRACT. ``test_default_*`` pin them against today's
default behaviour (observe-first autoclip/zscore_clip, zclip "clipped",
hist_clip "raw"), so that the tests of the new ``feedback`` values compare with
an oracle that is known to agree where the behaviour already exists.

Tolerance: rtol 3e-5 (float32 against float64) on every float field; ``z`` also has an
absolute 5e-5 (see ``restate.Z_ATOL``); counters and ``clipped`` exactly.
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

# ----------------------------------------------------------------------------
# Streams and clipper configurations
# ----------------------------------------------------------------------------

N = 300
# spikes x10, x100, x1000, x30 at steps 90, 140, 190, 240; a NaN inside every
# warm-up (step 10) and one after it (step 130), and an +inf at 200.
NORMS = R.with_nan(R.with_nan(R.spikes(N, 0)[0], [10, 130]), 200, math.inf)
SPIKES = (90, 140, 190, 240)

AUTO_KW = dict(warmup_steps=30, min_history=20)
WINDOW_KW = dict(mode="percentile", history="window", window_size=50, **AUTO_KW)
GEOM_KW = dict(mode="percentile", history="geometric", quantile_lr=0.05, **AUTO_KW)
ZSCORE_KW = dict(warmup_steps=30, min_history=20)
ZCLIP_KW = dict(warmup_steps=25, max_grad_norm=None)
ZCLIP_CAP_KW = dict(warmup_steps=25, max_grad_norm=20.0)  # cap fires on the large spikes
ZCLIP_PCT_KW = dict(warmup_steps=25, max_grad_norm=None, mode="percentile")
ZCLIP_MEAN_KW = dict(warmup_steps=25, max_grad_norm=5.0, clip_option="mean")
HIST_KW = dict(warmup_steps=20)


def _hist_tx(criterion: str = "zstat", **kw):
    crit = clipjax.zstat_criterion() if criterion == "zstat" else clipjax.ema_criterion()
    return clipjax.hist_clip(crit, warmup_clip=None, **kw)


# name -> (algo prefix, clipjax factory(feedback or None), restatement(norms, feedback or None))
def _cfg(algo, factory, restated, kw, rkw=None, default=None):
    rkw = kw if rkw is None else rkw

    def make(feedback=None, **extra):
        fkw = {} if feedback is None else {"feedback": feedback}
        return factory(**kw, **fkw, **extra)

    def want(norms, feedback=None):
        fb = default if feedback is None else feedback
        return restated(norms, **rkw, feedback=fb)

    return algo, make, want


CONFIGS = {
    "autoclip_auto": _cfg(
        "autoclip", clipjax.autoclip, S.autoclip, AUTO_KW, default="observe_first"
    ),
    "autoclip_window": _cfg(
        "autoclip", clipjax.autoclip, S.autoclip, WINDOW_KW, default="observe_first"
    ),
    "autoclip_geometric": _cfg(
        "autoclip", clipjax.autoclip, S.autoclip, GEOM_KW, default="observe_first"
    ),
    "zscore_clip": _cfg(
        "zscore_clip", clipjax.zscore_clip, S.zscore_clip, ZSCORE_KW, default="observe_first"
    ),
    "zclip": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_KW, default="clip_target"),
    "zclip_cap": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_CAP_KW, default="clip_target"),
    "zclip_percentile": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_PCT_KW, default="clip_target"),
    "zclip_mean": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_MEAN_KW, default="clip_target"),
    **{
        f"hist_{criterion}": _cfg(
            "hist_clip",
            partial(_hist_tx, criterion),
            S.hist_clip,
            HIST_KW,
            dict(HIST_KW, criterion=criterion),
            default="raw",
        )
        for criterion in ("zstat", "ema")
    },
}
# Feedback values each configuration accepts besides its default.
ACCEPTED = {
    "autoclip_auto": ("observe_first", "raw", "clipped", "skip"),
    "autoclip_window": ("observe_first", "raw", "clipped"),
    "autoclip_geometric": ("observe_first", "raw", "clipped"),
    "zscore_clip": ("observe_first", "raw", "clipped", "skip"),
    "zclip": ("raw", "clipped", "clip_target", "skip"),
    "zclip_cap": ("raw", "clipped", "clip_target", "skip"),
    "zclip_percentile": ("raw", "clipped", "clip_target", "skip"),
    "zclip_mean": ("raw", "clipped", "clip_target", "skip"),
    "hist_zstat": ("raw", "clipped", "clip_target", "skip"),
    "hist_ema": ("raw", "clipped", "clip_target", "skip"),
}
DEFAULT = {"autoclip": "observe_first", "zscore_clip": "observe_first", "zclip": "clip_target",
           "hist_clip": "raw"}  # fmt: skip
# Configurations whose default exists today (geometric is new).
TODAY = [c for c in CONFIGS if c != "autoclip_geometric"]


def _single(row):
    return {"w": row[0] * jnp.asarray(S.UNIT, jnp.float32)}


def _run_many(txs, seq, trees):
    """Runs every ``txs[i]`` on ``trees[i](row)`` of the same ``[steps, k]`` sequence in
    one jitted scan (one compile for many transforms). Per transform: its own
    ``clipjax.metrics`` (numpy ``[steps]``), output and input leaf norms, and
    "output identical to input" per leaf."""
    seq = jnp.asarray(np.asarray(seq, np.float64), jnp.float32)
    ones = jnp.ones(seq.shape[1], jnp.float32)
    params = [t(ones) for t in trees]
    state0 = tuple(tx.init(p) for tx, p in zip(txs, params))

    def step(states, row):
        new, rec = [], []
        for tx, st, tree, p in zip(txs, states, trees, params):
            grads = tree(row)
            out, st = tx.update(grads, st, p)
            same = jax.tree.map(lambda a, b: jnp.array_equal(a, b, equal_nan=True), out, grads)
            new.append(st)
            rec.append((clipjax.metrics(st), S.group_norms(out), S.group_norms(grads), same))
        return tuple(new), rec

    recs = jax.jit(lambda q: jax.lax.scan(step, state0, q)[1])(seq)
    return jax.tree.map(np.asarray, recs)


def _check_rec(rec, want, prefix, what=""):
    """One transform's record from ``_run_many`` vs a restatement (every leaf)."""
    got, outs, ins, same = rec
    try:
        S.compare(got, want, prefix)
        finite = np.isfinite(want["grad_norm"])
        for o, i, sm in zip(jax.tree.leaves(outs), jax.tree.leaves(ins), jax.tree.leaves(same)):
            np.testing.assert_allclose(o[finite] / i[finite], want["scale"][finite], rtol=S.RTOL)
            assert np.all(sm[~finite]), "a non-finite step must pass unchanged"
    except AssertionError as e:
        raise AssertionError(f"[{what}] {e}") from None


def _check_run(tx, norms, want, prefix):
    """Metrics, applied scale and pass-through of non-finite steps vs the restatement."""
    got, (outs, ins), same = S.run_tree(tx, np.asarray(norms)[:, None], _single)
    S.compare(got, want, prefix)
    finite = np.isfinite(want["grad_norm"])
    applied = outs["w"][finite] / ins["w"][finite]
    np.testing.assert_allclose(applied, want["scale"][finite], rtol=S.RTOL)
    assert np.all(np.asarray(same["w"])[~finite]), "a non-finite step must pass unchanged"
    return got


# ----------------------------------------------------------------------------
# The oracle agrees with today's defaults
# ----------------------------------------------------------------------------


def test_incremental_p2_is_the_shared_restatement():
    for seed in range(3):
        x = np.random.default_rng(seed).lognormal(0, 0.5, 400)
        p2 = S.P2Median()
        got = []
        for v in x:
            p2.observe(float(v))
            got.append(p2.value())
        np.testing.assert_array_equal(got, S.p2_restated(x, 0.5, textbook=True))


@pytest.mark.parametrize("config", TODAY)
def test_default_matches_restatement(config):
    algo, make, want = CONFIGS[config]
    _check_run(make(), NORMS, want(NORMS), f"{algo}/global/")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_feedback_matches_restatement(config):
    """Every feedback the configuration accepts, plus the default, in one scan
    (scope="global"); the default must equal its explicit value bit for bit."""
    algo, make, want = CONFIGS[config]
    fbs = ACCEPTED[config]
    txs = [make(fb) for fb in fbs] + [make()]
    recs = _run_many(txs, NORMS[:, None], [_single] * len(txs))
    for fb, rec in zip(fbs, recs):
        _check_rec(rec, want(NORMS, fb), f"{algo}/global/", f"{config} feedback={fb}")
        if fb == "skip":  # every spike fires and is not counted
            count = rec[0][f"{algo}/global/count"]
            assert all(count[t] == count[t - 1] for t in SPIKES), count[list(SPIKES)]
    explicit = fbs.index(DEFAULT[algo])
    for k, v in recs[-1][0].items():
        np.testing.assert_array_equal(v, recs[explicit][0][k], err_msg=f"default vs explicit: {k}")


@pytest.mark.parametrize("feedback", ["raw", "clipped"])
def test_ema_percentile_judge_first_is_observe_first_shifted(feedback):
    """history="ema" has no float64 restatement here; instead: in percentile mode
    "raw" and "clipped" both observe g, so the statistics (post-update)
    are the observe-first ones, and the threshold of step t is the observe-first
    quantile of step t-1 (floored at eps), used once count-before >= gate."""
    kw = dict(mode="percentile", history="ema", ema_decay=0.95, **AUTO_KW)
    eps = 1e-8
    base, _, _ = S.run_tree(clipjax.autoclip(**kw), NORMS[:, None], _single)
    tx = clipjax.autoclip(**kw, feedback=feedback, max_grad_norm=None)  # no ceiling
    got, _, _ = S.run_tree(tx, NORMS[:, None], _single)
    p = "autoclip/global/"
    np.testing.assert_allclose(got[p + "quantile"], base[p + "quantile"], rtol=S.RTOL)
    np.testing.assert_array_equal(got[p + "count"], base[p + "count"])
    q_prev = np.concatenate([[np.nan], base[p + "quantile"][:-1]])
    count_before = np.concatenate([[0], base[p + "count"][:-1]])
    finite = np.isfinite(NORMS)
    check = finite & (count_before >= 1)
    np.testing.assert_allclose(
        got[p + "threshold"][check], np.maximum(eps, q_prev[check]), rtol=S.RTOL
    )
    gate = max(AUTO_KW.values())
    open_ = finite & (count_before >= gate)
    scale = np.where(open_, np.minimum(1.0, np.maximum(eps, q_prev) / (NORMS + eps)), 1.0)
    np.testing.assert_allclose(got[p + "scale"][finite], scale[finite], rtol=S.RTOL)
    assert np.all(got[p + "scale"][~finite] == 1.0)
    # judged first, the spikes are cut to the quantile before them
    assert np.all(got[p + "scale"][list(SPIKES)] < 0.2)


# ----------------------------------------------------------------------------
# Scopes: each group equals the single-group restatement on its own stream
# ----------------------------------------------------------------------------

STREAMS3 = np.stack(
    [
        R.with_nan(R.spikes(N, 1)[0], [5, 150]),
        0.1 * R.with_nan(R.spikes(N, 2, at=[100, 170, 210, 260])[0], [120]),
        10.0 * R.with_nan(R.spikes(N, 3, at=[95, 135, 180, 280])[0], [60, 61]),
    ],
    axis=1,
)
SCOPE_CASES = {
    # defaults only: passes on today's code
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
    """A tree of 3 groups with different streams (scales 1, 0.1, 10; NaNs at different
    steps): each group equals the single-group restatement on its own stream."""
    make_tree = S.flat_tree if scope == "per_param" else S.layer_tree
    names = ["g0", "g1", "g2"] if scope == "per_param" else ["l0", "l1", "l2"]
    cases = SCOPE_CASES[cases]
    txs = [CONFIGS[c][1](fb, scope=scope) for c, fb in cases]
    recs = _run_many(txs, STREAMS3, [make_tree] * len(txs))
    for (config, fb), (got, outs, ins, same) in zip(cases, recs):
        algo, _, want = CONFIGS[config]
        for i, name in enumerate(names):
            w = want(STREAMS3[:, i], fb)
            group = {"g0": outs[name], "g1": ins[name], "g2": same[name]}
            sub = (got, {"x": group["g0"]}, {"x": group["g1"]}, {"x": group["g2"]})
            _check_rec(sub, w, f"{algo}/{name}/", f"{config} feedback={fb} {scope} {name}")


# ----------------------------------------------------------------------------
# axis_name: replicas with different local norms see the averaged norm
# ----------------------------------------------------------------------------

REPLICA_FACTORS = np.array([0.5, 1.0, 1.8])
AXIS_CASES = [("zclip", None), ("autoclip_auto", "raw"), ("zscore_clip", "clipped"),
              ("hist_zstat", "skip")]  # fmt: skip


@pytest.mark.parametrize("config, feedback", AXIS_CASES)
def test_axis_name_every_replica_sees_the_averaged_norm(config, feedback):
    algo, make, want = CONFIGS[config]
    tx = make(feedback, axis_name="i")
    reps = len(REPLICA_FACTORS)
    local = NORMS[:, None] * REPLICA_FACTORS[None, :]  # [steps, replicas]
    params = _single(jnp.ones(1))
    state0 = jax.tree.map(lambda a: jnp.broadcast_to(a, (reps, *a.shape)), tx.init(params))

    def step(state, row):
        grads = jax.vmap(_single)(row[:, None])
        upd = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="i")
        out, state = upd(grads, state)
        applied = jnp.linalg.norm(out["w"], axis=1) / jnp.linalg.norm(grads["w"], axis=1)
        return state, (clipjax.metrics(state), applied)

    run = jax.jit(lambda seq: jax.lax.scan(step, state0, seq)[1])
    metrics, applied = run(jnp.asarray(local, jnp.float32))
    w = want(local.mean(axis=1), feedback)
    finite = np.isfinite(w["grad_norm"])
    for r in range(reps):
        got = {k: np.asarray(v)[:, r] for k, v in metrics.items()}
        S.compare(got, w, f"{algo}/global/")
        np.testing.assert_allclose(np.asarray(applied)[finite, r], w["scale"][finite], rtol=S.RTOL)


# ----------------------------------------------------------------------------
# inject_hyperparams
# ----------------------------------------------------------------------------


def test_inject_hyperparams_zclip_feedback_clipped():
    tx = optax.inject_hyperparams(clipjax.zclip, static_args=("warmup_steps",))(
        z_thresh=2.0, warmup_steps=25, max_grad_norm=None, feedback="clipped"
    )
    want = S.zclip(NORMS, z_thresh=2.0, warmup_steps=25, max_grad_norm=None, feedback="clipped")
    _check_run(tx, NORMS, want, "zclip/global/")


@pytest.mark.parametrize("feedback", ["raw", "skip"])
def test_inject_hyperparams_zscore_clip_feedback(feedback):
    tx = optax.inject_hyperparams(clipjax.zscore_clip, static_args=("warmup_steps",))(
        zmax=2.5, feedback=feedback, **ZSCORE_KW
    )
    want = S.zscore_clip(NORMS, zmax=2.5, feedback=feedback, **ZSCORE_KW)
    _check_run(tx, NORMS, want, "zscore_clip/global/")


# ----------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------

SPIKE_CONFIGS = ["autoclip_auto", "zscore_clip", "zclip", "hist_zstat"]
# The level the statistics set after a step (post-update metrics): what the next
# step is judged against.
LEVEL = {
    "autoclip": lambda m, p: m[p + "median"] + 3.0 * m[p + "std"],
    "zscore_clip": lambda m, p: m[p + "mean"] + 3.0 * m[p + "std"],
    "zclip": lambda m, p: m[p + "mean"] + 2.5 * m[p + "std"],
    "hist_clip": lambda m, p: m[p + "mean"] + 2.5 * m[p + "std"],
}


@pytest.mark.parametrize("config", SPIKE_CONFIGS)
def test_spike_moves_threshold_no_more_than_its_clip_value(config):
    """Replace the x1000 spike by the value it is clipped to (its threshold; no
    max_grad_norm cap in these configurations): under "clipped" the statistics
    after it are those of the replaced stream; under "skip" they do not move
    ; "raw" feedback of the spike moves them much more."""
    algo, configured, _ = CONFIGS[config]
    # No ceiling (zclip's configurations already say max_grad_norm=None).
    make = configured if algo == "zclip" else partial(configured, max_grad_norm=None)
    t = SPIKES[2]
    norms = R.spikes(N, 0)[0]
    key = f"{algo}/global/"
    level = LEVEL[algo]
    a = _run_many([make("clipped"), make("skip"), make("raw")], norms[:, None], [_single] * 3)
    clipped, skipped, raw = (r[0] for r in a)
    assert clipped[key + "clipped"][t] and skipped[key + "clipped"][t]
    replaced = norms.copy()
    replaced[t] = clipped[key + "threshold"][t]
    ((ref_c, *_),) = _run_many([make("clipped")], replaced[:, None], [_single])
    np.testing.assert_allclose(level(clipped, key)[t], level(ref_c, key)[t], rtol=1e-4)
    # skip: the spike does not move the statistics at all (observing its clip value
    # may move them a little either way: zclip's variance shrinks when it observes
    # a value close to its mean, so "no higher than the replaced run" is not a law)
    for f in ("median", "mean", "std", "count"):
        if key + f in skipped:
            assert skipped[key + f][t] == skipped[key + f][t - 1], f
    assert level(raw, key)[t] > 2 * level(clipped, key)[t]


def test_zclip_skip_update_on_spike_is_feedback_skip():
    a, _, _ = S.run_tree(
        clipjax.zclip(skip_update_on_spike=True, **ZCLIP_KW), NORMS[:, None], _single
    )
    b, _, _ = S.run_tree(clipjax.zclip(feedback="skip", **ZCLIP_KW), NORMS[:, None], _single)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    S.compare(a, S.zclip(NORMS, feedback="skip", **ZCLIP_KW), "zclip/global/")


def test_zclip_conflicting_skip_alias_raises():
    with pytest.raises(ValueError, match=r"feedback|skip_update_on_spike"):
        clipjax.zclip(skip_update_on_spike=True, feedback="raw")


INVALID = [  # factory names: adagc may not exist yet, and must not break collection
    ("autoclip", dict(mode="percentile", history="window"), "skip"),
    ("autoclip", dict(mode="percentile", history="ema"), "skip"),
    ("autoclip", dict(mode="percentile", history="geometric"), "skip"),
    ("zclip", {}, "observe_first"),
    ("hist_clip", {}, "observe_first"),
    ("adagc", {}, "observe_first"),
    ("autoclip", {}, "bogus"),
    ("autoclip", dict(mode="percentile"), "bogus"),
    ("zscore_clip", {}, "bogus"),
    ("zclip", {}, "bogus"),
    ("hist_clip", {}, "bogus"),
    ("adagc", {}, "bogus"),
    ("autoclip", {}, "clip_target"),
    ("zscore_clip", {}, "clip_target"),
    ("adagc", {}, "clip_target"),
]


@pytest.mark.parametrize(
    "factory, kw, feedback", INVALID, ids=[f"{f}-{v}-{i}" for i, (f, _, v) in enumerate(INVALID)]
)
def test_invalid_feedback_raises(factory, kw, feedback):
    with pytest.raises(ValueError, match="feedback"):
        getattr(clipjax, factory)(**kw, feedback=feedback)
