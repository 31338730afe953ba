"""The reference drivers (``tests/references/``) against float64 restatements of each
reference's formulas on short sequences: what the differential tests compare with."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from tests import references as R
from tests import restate as S
from tests.paths import ROOT

# Slow, `make test` skips it: traces of smartclip, zclip and drytorch (torch); each
# clipper's own file keeps a short reference check in the fast suite.
pytestmark = pytest.mark.slow

INF = math.inf
_TORCH = "torch (CPU build) is not installed: zclip and drytorch references need it"
smartclip_available = pytest.mark.skipif(not R.have_smartclip(), reason="smartclip not installed")
zclip_available = pytest.mark.skipif(not R.have_zclip(), reason=f"{_TORCH}, or zclip")
drytorch_available = pytest.mark.skipif(not R.have_drytorch(), reason=f"{_TORCH}, or drytorch")


_short = lambda: R.spikes(40, 0)[0]  # spikes ×10, ×100, ×1000, ×30 at steps 12, 19, 25, 32


def test_generators_are_deterministic_and_positive():
    x, idx = R.spikes()
    for a, b in zip((x, idx), R.spikes()):
        np.testing.assert_array_equal(a, b)
    assert x.dtype == np.float64 and x.shape == (400,)
    assert np.all(x > 0) and np.all(np.isfinite(x))
    np.testing.assert_array_equal(idx, [120, 187, 253, 320])
    base = np.delete(x, idx)
    assert 0.9 < np.median(base) < 1.1
    # Each spike is its factor times a base value of the same distribution.
    ratios = x[idx] / np.median(base)
    for r, f in zip(ratios, R.SPIKE_FACTORS):
        assert 0.5 * f < r < 2.0 * f
    assert not np.array_equal(R.spikes(seed=1)[0], x)

    y = R.regime_shift()
    assert y.shape == (600,) and np.all(y > 0)
    ratio = np.median(y[300:]) / np.median(y[:300])
    assert 0.18 < ratio < 0.22
    np.testing.assert_array_equal(R.regime_shift(), y)

    np.testing.assert_array_equal(R.constant(5, 2.0), [2.0] * 5)

    z = R.with_nan(x, at=70)
    assert np.isnan(z[70]) and np.isfinite(x[70])  # a copy
    assert np.isnan(z).sum() == 1
    assert np.isposinf(R.with_nan(x, at=[3, 4], value=np.inf)[[3, 4]]).all()


def test_import_does_not_need_torch():
    code = (
        "import sys\n"
        "for m in ('torch', 'zclip', 'drytorch'): sys.modules[m] = None\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests import references as R\n"
        "assert R.spikes()[0].shape == (400,)\n"
        "assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _scale_smartclip(g, t, gate_open, eps):
    return 1.0 if not gate_open or g + eps <= t else max(t / (g + eps), 0.0)


@smartclip_available
def test_smartclip_window_percentile_is_numpy_percentile():
    x = _short()
    w, pct, eps = 8, 90.0, 1e-8
    r = R.smartclip_autoclip(
        x, mode="percentile", history="window", window_size=w, percentile=pct,
        warmup_steps=10, min_history=5, eps=eps,
    )  # fmt: skip
    for t in range(len(x)):
        q = np.percentile(x[max(0, t + 1 - w) : t + 1], pct)
        assert r["quantile"][t] == pytest.approx(q, rel=1e-13)
        assert r["threshold"][t] == pytest.approx(max(q, eps), rel=1e-13)
        assert r["window_len"][t] == min(t + 1, w)
        assert r["can_clip"][t] == (t + 1 >= 10)
        assert r["count"][t] == t + 1
        assert r["scale"][t] == _scale_smartclip(x[t], r["threshold"][t], t + 1 >= 10, eps)
    assert r["clipped"][12] and r["clipped"][25]  # spikes after the gate opens
    np.testing.assert_array_equal(r["clipped"], r["scale"] < 1)


@smartclip_available
def test_smartclip_auto_mode_median_std_threshold():
    x = _short()
    eps = 1e-8
    r = R.smartclip_autoclip(x, mode="auto", warmup_steps=10, min_history=5, eps=eps)
    assert set(r) >= {"median", "std", "mean", "var", "threshold", "scale"}
    for t in range(len(x)):
        h = x[: t + 1]
        assert r["mean"][t] == pytest.approx(h.mean(), rel=1e-12)
        if t >= 1:
            assert r["std"][t] == pytest.approx(h.std(ddof=1), rel=1e-10)
            assert r["var"][t] == pytest.approx(h.var(ddof=1), rel=1e-10)
        else:
            assert np.isnan(r["std"][t])
        if t < 4:  # P² undefined below 5 observations: smartclip's T is eps
            assert np.isnan(r["median"][t]) and r["threshold"][t] == eps
        else:
            assert r["threshold"][t] == pytest.approx(r["median"][t] + 3 * r["std"][t], rel=1e-14)
        assert r["scale"][t] == _scale_smartclip(x[t], r["threshold"][t], t + 1 >= 10, eps)
    assert r["median"][4] == np.median(x[:5])
    np.testing.assert_allclose(r["median"], S.p2_restated(x), rtol=1e-14)


@smartclip_available
def test_smartclip_ema_percentile_restated_and_never_decreases():
    x = R.regime_shift(200, factor=0.2)
    r = R.smartclip_autoclip(x, mode="percentile", history="ema", percentile=90.0, ema_decay=0.9)
    q, p, a = None, 0.9, 1 - 0.9
    for t, v in enumerate(x):
        q = v if q is None else q + a * (v - q) * (p - (1.0 if v < q else 0.0))
        assert r["quantile"][t] == pytest.approx(q, rel=1e-13)
    # smartclip's update can only move up (clipjax fixes this): it never follows the drop.
    assert np.all(np.diff(r["quantile"]) >= 0)
    assert r["quantile"][-1] > 1.0


@smartclip_available
def test_smartclip_zscore_ema_moments():
    x = _short()
    d, zmax, eps = 0.9, 2.0, 1e-8
    r = R.smartclip_zscore(x, zmax=zmax, ema_decay=d, warmup_steps=10, min_history=5, eps=eps)
    m = m2 = None
    for t, v in enumerate(x):
        m = v if m is None else d * m + (1 - d) * v
        m2 = v * v if m2 is None else d * m2 + (1 - d) * v * v
        var = max(0.0, m2 - m * m)
        assert r["mean"][t] == pytest.approx(m, rel=1e-13)
        assert r["var"][t] == pytest.approx(var, rel=1e-9, abs=1e-12)
        assert r["std"][t] == pytest.approx(math.sqrt(var), rel=1e-9, abs=1e-9)
        thr = max(eps, m + zmax * math.sqrt(var))
        assert r["threshold"][t] == pytest.approx(thr, rel=1e-9)
        assert r["scale"][t] == pytest.approx(
            _scale_smartclip(v, r["threshold"][t], t + 1 >= 10, eps), rel=1e-12
        )
        assert r["can_clip"][t] == (t + 1 >= 10)
    assert r["clipped"][12]


@smartclip_available
def test_smartclip_nonfinite_behaviour():
    x = R.with_nan(_short(), at=20)
    kw = dict(mode="auto", warmup_steps=10, min_history=5)
    r = R.smartclip_autoclip(x, **kw)
    # Guarded: nothing observed or counted, T unchanged, but the backend's scale is NaN.
    assert r["count"][20] == r["count"][19] == 20 and r["count"][21] == 21
    assert r["threshold"][20] == r["threshold"][19]
    assert r["mean"][20] == r["mean"][19]
    assert np.isnan(r["scale"][20])
    # +inf: scale 0 (T / inf).
    ri = R.smartclip_autoclip(R.with_nan(_short(), 20, np.inf), **kw)
    assert ri["scale"][20] == 0.0 and ri["count"][20] == 20
    # Unguarded: NaN enters the statistics as eps (ensure_positive), not as NaN.
    ru = R.smartclip_autoclip(x, guard_nans=False, **kw)
    h = np.concatenate([_short()[:20], [1e-8]])
    assert ru["count"][20] == 21
    assert ru["mean"][20] == pytest.approx(h.mean(), rel=1e-12)
    assert np.isfinite(ru["threshold"][21:]).all()
    # Before the gate opens the scale is 1 even for NaN.
    rg = R.smartclip_zscore(R.with_nan(_short(), 3), warmup_steps=10, min_history=5)
    assert rg["scale"][3] == 1.0 and rg["count"][3] == 3


def _zclip_np(x, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup_steps=25):
    """zclip (mode="zscore", clip_option="adaptive_scaling") restated in float64."""
    buf, mean, var = [], None, None
    res = {k: [] for k in ("threshold", "scale", "mean", "var", "spike")}
    cap = INF if max_grad_norm is None else max_grad_norm
    for g in x:
        if mean is None:
            buf.append(g)
            if len(buf) >= warmup_steps:
                mean, var = float(np.mean(buf)), float(np.var(buf))
            thr, scale, spike = cap, min(1.0, cap / (g + 1e-6)), False
        else:
            std = math.sqrt(var)
            z = (g - mean) / (std + eps)
            spike = z > z_thresh
            cv = (mean + z_thresh * std / (z / z_thresh)) if spike else g
            thr = min(cv, cap)
            scale = thr / (g + 1e-6) if g > thr else 1.0
            mean = alpha * mean + (1 - alpha) * cv
            var = alpha * var + (1 - alpha) * (cv - mean) ** 2
        stats = (math.nan if mean is None else mean, math.nan if var is None else var)
        for k, v in zip(res, (thr, scale, *stats, spike)):
            res[k].append(v)
    return {k: np.asarray(v) for k, v in res.items()}


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@zclip_available
def test_zclip_matches_restatement(max_grad_norm):
    x = _short()
    w = 10
    r = R.zclip_reference(x, warmup_steps=w, max_grad_norm=max_grad_norm)
    e = _zclip_np(x, warmup_steps=w, max_grad_norm=max_grad_norm)
    np.testing.assert_allclose(r["grad_norm"], x, rtol=1e-15)
    np.testing.assert_array_equal(r["warmup"], np.arange(40) < w)
    np.testing.assert_array_equal(r["initialized"], np.arange(40) >= w - 1)
    # Statistics once the warm-up set is complete: population mean and variance.
    assert r["mean"][w - 1] == pytest.approx(np.mean(x[:w]), rel=1e-14)
    assert r["var"][w - 1] == pytest.approx(np.var(x[:w]), rel=1e-12)
    assert np.isnan(r["mean"][: w - 1]).all() and np.isnan(r["z"][:w]).all()
    np.testing.assert_allclose(r["threshold"], e["threshold"], rtol=1e-13)
    np.testing.assert_allclose(r["scale"], e["scale"], rtol=1e-12)
    np.testing.assert_allclose(r["mean"], e["mean"], rtol=1e-13)
    np.testing.assert_allclose(r["var"], e["var"], rtol=1e-11)
    np.testing.assert_allclose(r["std"], np.sqrt(e["var"]), rtol=1e-11)
    np.testing.assert_array_equal(r["spike"], e["spike"])
    assert r["spike"][[12, 19, 25, 32]].all()
    # clip_val is set exactly on spikes and then equals the threshold when below the cap.
    np.testing.assert_array_equal(~np.isnan(r["clip_val"]), r["spike"])
    assert (r["error"] == "").all() and r["finite_out"].all()
    if max_grad_norm is None:  # float32 close to float64
        b = R.zclip_reference(x, warmup_steps=w, max_grad_norm=None, dtype="float32")
        np.testing.assert_allclose(b["threshold"], r["threshold"], rtol=1e-5)
        np.testing.assert_allclose(b["scale"], r["scale"], rtol=1e-5)


@zclip_available
def test_zclip_clips_the_spikes():
    x, idx = R.spikes()
    r = R.zclip_reference(x, max_grad_norm=None)
    assert r["spike"][idx].all()
    # Adaptive scaling clips a ×1000 spike to about the running mean.
    k = idx[2]
    assert r["scale"][k] < 2e-3
    assert 0.8 < r["threshold"][k] < 1.3
    # Outside the spikes (after warm-up) the threshold is the norm itself.
    calm = ~r["spike"] & ~r["warmup"]
    np.testing.assert_allclose(r["threshold"][calm], r["grad_norm"][calm], rtol=0)
    assert (r["scale"][calm] == 1.0).all()


@zclip_available
def test_zclip_nan_poisons_but_does_not_crash():
    x = R.with_nan(_short(), at=15)
    r = R.zclip_reference(x, warmup_steps=10, max_grad_norm=1.0)
    assert (r["error"] == "").all()
    assert np.isfinite(r["mean"][10:15]).all() and np.isnan(r["mean"][15:]).all()
    assert np.isnan(r["threshold"][15])  # min(nan, max_grad_norm) is nan
    assert r["scale"][15] == 1.0 and not r["finite_out"][15]
    # Poisoned: no spike is detected any more; only max_grad_norm still caps.
    assert not r["spike"][16:].any()
    np.testing.assert_allclose(r["threshold"][16:], np.minimum(x[16:], 1.0), rtol=0)
    # During warm-up a NaN is collected: the statistics start as NaN.
    rw = R.zclip_reference(R.with_nan(_short(), at=3), warmup_steps=10, max_grad_norm=None)
    assert np.isnan(rw["mean"][9:]).all() and (rw["error"] == "").all()
    assert (rw["threshold"][:10] == INF).all()


# ----------------------------------------------------------------------------
# drytorch
# ----------------------------------------------------------------------------

_F = {
    "reciprocal": lambda z, t: t * t / z,
    "max": lambda z, t: t,
    "mean": lambda z, t: 0.0,
}


def _hist_np(x, criterion="zstat", clip="reciprocal", alpha=0.97, thresh=2.5, n_warm=20, wmax=1.0):
    """drytorch HistClipper restated in float64 (one group)."""
    f = _F[clip]
    buf, active, mu, v = [], True, 0.0, 1.0
    res = {k: [] for k in ("threshold", "scale", "mean", "var", "warmup", "fired")}
    for g in x:
        if active and len(buf) < n_warm:
            buf.append(g)
            scale = 1.0 if wmax is None else min(1.0, wmax / (g + 1e-6))
            for k, val in zip(res, (INF, scale, mu, v, True, False)):
                res[k].append(val)
            continue
        if active:
            active = False
            mu = float(np.mean(buf)) if buf else 0.0
            var = float(np.var(buf, ddof=1)) if len(buf) > 1 else 1.0
            if var > 0:
                v = var
        if criterion == "zstat":
            z = (g - mu) / (math.sqrt(v) + 1e-8)
            fired = mu != 0.0 and abs(z) > thresh
            cv = mu + f(abs(z), thresh) * math.sqrt(v) if fired else INF
            v = alpha * v + (1 - alpha) * (g - mu) ** 2
        else:
            fired = mu != 0.0 and g / mu > thresh
            cv = mu * f(g / mu, thresh) if fired else INF
        mu = alpha * mu + (1 - alpha) * g
        scale = min(1.0, cv / (g + 1e-6)) if fired else 1.0
        for k, val in zip(res, (cv, scale, mu, v, False, fired)):
            res[k].append(val)
    return {k: np.asarray(val) for k, val in res.items()}


@pytest.mark.parametrize(
    "criterion,clip,alpha,thresh",
    [
        ("zstat", "reciprocal", 0.97, 2.5),
        ("zstat", "max", 0.9, 2.0),
        ("zstat", "mean", 0.97, 2.5),
        ("ema", "max", 0.98, 1.05),
        ("ema", "reciprocal", 0.9, 1.5),
    ],
)
@drytorch_available
def test_drytorch_matches_restatement(criterion, clip, alpha, thresh):
    x = _short()
    n_warm = 10
    kw = {"z_thresh": thresh} if criterion == "zstat" else {"r_thresh": thresh}
    r = R.drytorch_reference(
        x, criterion=criterion, clip=clip, alpha=alpha, n_warmup_steps=n_warm, **kw
    )
    e = _hist_np(x, criterion, clip, alpha, thresh, n_warm, 1.0)
    np.testing.assert_allclose(r["grad_norm"], x, rtol=1e-15)
    np.testing.assert_array_equal(r["warmup"], np.arange(40) < n_warm)
    np.testing.assert_array_equal(r["warmup"], e["warmup"])
    np.testing.assert_array_equal(r["fired"], e["fired"])
    np.testing.assert_allclose(r["threshold"], e["threshold"], rtol=1e-13)
    np.testing.assert_allclose(r["scale"], e["scale"], rtol=1e-12)
    np.testing.assert_allclose(r["mean"], e["mean"], rtol=1e-13)
    if criterion == "zstat":
        np.testing.assert_allclose(r["var"], e["var"], rtol=1e-12)
        np.testing.assert_allclose(r["std"], np.sqrt(e["var"]), rtol=1e-12)
    # First post-warm-up step: statistics initialised from the warm-up samples.
    if criterion == "zstat":
        mu0, v0 = np.mean(x[:n_warm]), np.var(x[:n_warm], ddof=1)
        z = (x[n_warm] - mu0) / (np.sqrt(v0) + 1e-8)
        assert r["z"][n_warm] == pytest.approx(z, rel=1e-12)
        assert r["var"][n_warm] == pytest.approx(
            alpha * v0 + (1 - alpha) * (x[n_warm] - mu0) ** 2, rel=1e-12
        )
    else:
        assert r["ratio"][n_warm] == pytest.approx(x[n_warm] / np.mean(x[:n_warm]), rel=1e-13)
    assert r["fired"][12] and r["clipped"][12]
    np.testing.assert_array_equal(r["hist_scale"][:n_warm], 1.0)
    np.testing.assert_array_equal(r["threshold"][~r["fired"]], INF)


@drytorch_available
def test_drytorch_warmup_clip_and_threshold_conventions():
    x = _short() * 2.0  # above the warm-up max norm 1.0
    r = R.drytorch_reference(x, n_warmup_steps=10, warmup_max_norm=1.0)
    np.testing.assert_allclose(r["scale"][:10], 1.0 / (x[:10] + 1e-6), rtol=1e-12)
    np.testing.assert_array_equal(r["warmup_threshold"][:10], 1.0)
    assert np.isnan(r["warmup_threshold"][10:]).all()
    np.testing.assert_array_equal(r["threshold"][:10], INF)
    np.testing.assert_array_equal(r["mean"][:10], 0.0)  # drytorch's initial values
    np.testing.assert_array_equal(r["var"][:10], 1.0)
    np.testing.assert_array_equal(r["n_collected"], np.minimum(np.arange(1, 41), 10))
    rn = R.drytorch_reference(x, n_warmup_steps=10, warmup_max_norm=None)
    np.testing.assert_array_equal(rn["scale"][:10], 1.0)
    np.testing.assert_array_equal(rn["warmup_threshold"][:10], INF)


@drytorch_available
def test_drytorch_low_side_fire_and_constant_warmup():
    # Constant warm-up: ddof-1 variance 0 is not taken, v stays 1.0.
    x = R.constant(30, 1.0)
    x[25] = 0.001
    r = R.drytorch_reference(x, n_warmup_steps=10, alpha=0.97, z_thresh=0.5)
    assert r["var"][10] == pytest.approx(0.97 * 1.0, rel=1e-14)  # 1.0 then one update
    assert not r["fired"][10:25].any()
    # |z| > z_thresh on the low side fires: the clip value is reported, the scale stays 1.
    assert r["fired"][25] and r["z"][25] < -0.5
    assert np.isfinite(r["threshold"][25]) and r["threshold"][25] > x[25]
    assert r["scale"][25] == 1.0 and not r["clipped"][25]


@drytorch_available
def test_drytorch_ema_mean_clipping_zeroes_the_gradient():
    x = _short()
    r = R.drytorch_reference(x, criterion="ema", clip="mean", n_warmup_steps=10)
    assert r["fired"][12]
    assert r["threshold"][12] == 0.0 and r["scale"][12] == 0.0


@drytorch_available
def test_drytorch_per_param_and_multi_leaf_global():
    x = _short()
    y = R.regime_shift(40, seed=3)
    xy = np.stack([x, y], axis=1)
    rp = R.drytorch_reference(xy, per_param=True, n_warmup_steps=10)
    assert rp["scale"].shape == (40, 2) and rp["threshold"].shape == (40, 2)
    for j, col in enumerate((x, y)):
        r1 = R.drytorch_reference(col, n_warmup_steps=10)
        for k in ("threshold", "scale", "mean", "var", "z", "fired", "warmup"):
            np.testing.assert_allclose(rp[k][:, j], r1[k], rtol=1e-12, err_msg=k)
    rg = R.drytorch_reference(xy, per_param=False, n_warmup_steps=10)
    r1 = R.drytorch_reference(np.hypot(x, y), n_warmup_steps=10)
    assert rg["scale"].shape == (40,)
    for k in ("threshold", "scale", "mean", "var"):
        np.testing.assert_allclose(rg[k], r1[k], rtol=1e-12, err_msg=k)


@drytorch_available
def test_drytorch_nonfinite_poisons():
    x = R.with_nan(_short(), at=15)
    r = R.drytorch_reference(x, n_warmup_steps=10)
    assert np.isnan(r["mean"][15:]).all()
    assert not r["fired"][15:].any()  # NaN comparisons are False: never clips again
    np.testing.assert_array_equal(r["scale"][16:], 1.0)
    ri = R.drytorch_reference(R.with_nan(_short(), 15, np.inf), n_warmup_steps=10)
    assert ri["fired"][15] and not ri["finite_out"][15]  # inf * 0 = NaN gradient
    assert np.isposinf(ri["mean"][15:]).all() and not ri["fired"][16:].any()
