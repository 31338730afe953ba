"""SPEC 9.1 ``feedback``: every adaptive clipper against a float64 restatement.

The restatements live in ``tests/restate.py`` and are written from SPEC 3, 4,
8, 9.1 and the 0.2 CONTRACT. ``test_default_*`` pin them against today's
default behaviour (observe-first autoclip/zscore_clip, zclip "clipped",
hist_clip "raw"), so that the tests of the new ``feedback`` values compare with
an oracle that is known to agree where the behaviour already exists.

Tolerance: rtol 3e-5 (SPEC 8.14) on every float field; ``z`` also has an
absolute 5e-5 (see ``restate.Z_ATOL``); counters and ``clipped`` exactly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as R
import restate as S

import clipjax

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
    "zclip": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_KW, default="clipped"),
    "zclip_cap": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_CAP_KW, default="clipped"),
    "zclip_percentile": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_PCT_KW, default="clipped"),
    "zclip_mean": _cfg("zclip", clipjax.zclip, S.zclip, ZCLIP_MEAN_KW, default="clipped"),
    "hist_zstat": _cfg(
        "hist_clip",
        lambda **k: _hist_tx("zstat", **k),
        S.hist_clip,
        HIST_KW,
        dict(HIST_KW, criterion="zstat"),
        default="raw",
    ),
    "hist_ema": _cfg(
        "hist_clip",
        lambda **k: _hist_tx("ema", **k),
        S.hist_clip,
        HIST_KW,
        dict(HIST_KW, criterion="ema"),
        default="raw",
    ),
}
# Feedback values each configuration accepts besides its default (SPEC 9.1).
ACCEPTED = {
    "autoclip_auto": ("observe_first", "raw", "clipped", "skip"),
    "autoclip_window": ("observe_first", "raw", "clipped"),
    "autoclip_geometric": ("observe_first", "raw", "clipped"),
    "zscore_clip": ("observe_first", "raw", "clipped", "skip"),
    "zclip": ("raw", "clipped", "skip"),
    "zclip_cap": ("raw", "clipped", "skip"),
    "zclip_percentile": ("raw", "clipped", "skip"),
    "zclip_mean": ("raw", "clipped", "skip"),
    "hist_zstat": ("raw", "clipped", "skip"),
    "hist_ema": ("raw", "clipped", "skip"),
}
CASES = [(c, f) for c in CONFIGS for f in ACCEPTED[c]]
# Configurations whose default exists today (geometric is new).
TODAY = [c for c in CONFIGS if c != "autoclip_geometric"]


def _single(row):
    return {"w": row[0] * jnp.asarray(S.UNIT, jnp.float32)}


def _check_run(tx, norms, want, prefix, leaf=("w",)):
    """Metrics, applied scale and pass-through of non-finite steps vs the restatement."""
    got, (outs, ins), same = S.run_tree(tx, np.asarray(norms)[:, None], _single)
    S.compare(got, want, prefix)
    finite = np.isfinite(want["grad_norm"])
    applied = outs["w"][finite] / ins["w"][finite]
    finite = np.isfinite(want["grad_norm"])
    np.testing.assert_allclose(applied, want["scale"][finite], rtol=S.RTOL)
    assert np.all(np.asarray(same["w"])[~finite]), "a non-finite step must pass unchanged"
    return got


# ----------------------------------------------------------------------------
# The oracle agrees with today's defaults
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("config", TODAY)
def test_default_matches_restatement(config):
    algo, make, want = CONFIGS[config]
    _check_run(make(), NORMS, want(NORMS), f"{algo}/global/")


@pytest.mark.parametrize("config", TODAY)
def test_default_equals_explicit_default_feedback(config):
    algo, make, _ = CONFIGS[config]
    default = {"autoclip": "observe_first", "zscore_clip": "observe_first"}.get(
        algo, "clipped" if algo == "zclip" else "raw"
    )
    a, _, _ = S.run_tree(make(), NORMS[:, None], _single)
    b, _, _ = S.run_tree(make(default), NORMS[:, None], _single)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ----------------------------------------------------------------------------
# Every accepted feedback, scope="global", step by step
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("config, feedback", CASES)
def test_feedback_matches_restatement(config, feedback):
    algo, make, want = CONFIGS[config]
    _check_run(make(feedback), NORMS, want(NORMS, feedback), f"{algo}/global/")


@pytest.mark.parametrize("feedback", ["raw", "clipped"])
def test_ema_percentile_judge_first_is_observe_first_shifted(feedback):
    """history="ema" has no float64 restatement here; instead: in percentile mode
    "raw" and "clipped" both observe g (SPEC 9.1), so the statistics (post-update)
    are the observe-first ones, and the threshold of step t is the observe-first
    quantile of step t-1 (floored at eps), used once count-before >= gate."""
    kw = dict(mode="percentile", history="ema", ema_decay=0.95, **AUTO_KW)
    eps = 1e-8
    base, _, _ = S.run_tree(clipjax.autoclip(**kw), NORMS[:, None], _single)
    got, _, _ = S.run_tree(clipjax.autoclip(**kw, feedback=feedback), NORMS[:, None], _single)
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
SCOPE_CASES = [
    ("autoclip_auto", None),
    ("autoclip_auto", "clipped"),
    ("autoclip_window", "raw"),
    ("zscore_clip", "skip"),
    ("zclip", None),
    ("zclip", "raw"),
    ("zclip_percentile", "skip"),
    ("hist_zstat", None),
    ("hist_zstat", "clipped"),
    ("hist_ema", "skip"),
]


@pytest.mark.parametrize("scope", ["per_param", "per_layer"])
@pytest.mark.parametrize("config, feedback", SCOPE_CASES)
def test_scopes_match_per_group_restatement(config, feedback, scope):
    algo, make, want = CONFIGS[config]
    make_tree = S.flat_tree if scope == "per_param" else S.layer_tree
    names = ["g0", "g1", "g2"] if scope == "per_param" else ["l0", "l1", "l2"]
    got, (outs, ins), same = S.run_tree(make(feedback, scope=scope), STREAMS3, make_tree)
    for i, name in enumerate(names):
        w = want(STREAMS3[:, i], feedback)
        S.compare(got, w, f"{algo}/{name}/")
        finite = np.isfinite(STREAMS3[:, i])
        leaves = [f"g{i}"] if scope == "per_param" else [f"l{i}/kernel", f"l{i}/bias"]
        for leaf in leaves:
            o, n = outs, ins
            for part in leaf.split("/"):
                o, n = o[part], n[part]
            np.testing.assert_allclose((o / n)[finite], w["scale"][finite], rtol=S.RTOL)


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

SPIKE_CONFIGS = ["autoclip_auto", "zscore_clip", "zclip", "zclip_percentile", "hist_zstat"]


def _threshold_key(algo):
    return f"{algo}/global/threshold"


@pytest.mark.parametrize("config", SPIKE_CONFIGS)
@pytest.mark.parametrize("feedback", ["clipped", "skip"])
def test_spike_moves_threshold_no_more_than_its_clip_value(config, feedback):
    """Replace the spike by the value it is clipped to: under "clipped" the next
    threshold is the same, under "skip" it is no higher (SPEC 9.1)."""
    algo, make, _ = CONFIGS[config]
    t = SPIKES[2]  # the x1000 spike
    norms = R.spikes(N, 0)[0]
    got, _, _ = S.run_tree(make(feedback), norms[:, None], _single)
    key = f"{algo}/global/"
    assert got[key + "clipped"][t]
    # no max_grad_norm cap in these configurations: the threshold is the clip value
    clip_to = got[key + "threshold"][t]
    replaced = norms.copy()
    replaced[t] = clip_to
    ref, _, _ = S.run_tree(make("clipped"), replaced[:, None], _single)
    after, ref_after = got[key + "threshold"][t + 1], ref[key + "threshold"][t + 1]
    if feedback == "clipped":
        np.testing.assert_allclose(after, ref_after, rtol=1e-4)
    else:
        assert after <= ref_after * (1 + 1e-5)
    # and far below what raw feedback of the spike gives (it is a x1000 spike)
    raw, _, _ = S.run_tree(make("raw"), norms[:, None], _single)
    assert raw[key + "threshold"][t + 1] > 2 * after


@pytest.mark.parametrize("config", [c for c in CONFIGS if "skip" in ACCEPTED[c]])
def test_skip_leaves_count_unchanged_on_a_fired_step(config):
    algo, make, want = CONFIGS[config]
    norms = R.spikes(N, 0)[0]
    got, _, _ = S.run_tree(make("skip"), norms[:, None], _single)
    count = got[f"{algo}/global/count"]
    prev = np.concatenate([[0], count[:-1]])
    w = want(norms, "skip")
    fired = w["count"] == np.concatenate([[0], w["count"][:-1]])
    assert fired[list(SPIKES)].all()
    np.testing.assert_array_equal(count - prev, np.where(fired, 0, 1))


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
]


@pytest.mark.parametrize(
    "factory, kw, feedback", INVALID, ids=[f"{f}-{v}-{i}" for i, (f, _, v) in enumerate(INVALID)]
)
def test_invalid_feedback_raises(factory, kw, feedback):
    with pytest.raises(ValueError, match="feedback"):
        getattr(clipjax, factory)(**kw, feedback=feedback)
