"""hist_clip against drytorch's HistClipper / ParamHistClipper, its FIXes, and its warm-up
clip's nested metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import drive
from tests import references as R

needs_drytorch = pytest.mark.skipif(
    not R.have_drytorch(), reason="drytorch/torch not installed: pip install torch==2.13.0 drytorch"
)
FNS = {
    "max": clipjax.max_clipping,
    "mean": clipjax.mean_clipping,
    "reciprocal": clipjax.reciprocal_clipping,
}
STREAMS = {"spikes": lambda: R.spikes()[0], "regime_shift": R.regime_shift, "constant": R.constant}
RTOL = 3e-5


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL) -> None:
    drive.assert_close(got, want, rtol=rtol, atol=2e-6)


# torch's clip_grad_norm_ divides by (norm + 1e-6): the warm-up clip that matches it.
TORCH_WARMUP = clipjax.clip_by_global_norm(1.0, eps=1e-6)


def assert_matches_reference(got: dict, ref: dict, norms: np.ndarray, kind: str = "zstat") -> None:
    """drytorch's threshold (the clip value on a fire) is clipjax's ``clip_to`` on a clipped
    step, the norm elsewhere; clipjax's ``threshold`` is the boundary from the statistics
    before the step, and the warm-up clip's (1.0) during the warm-up."""
    norms = np.asarray(norms, np.float64)
    if norms.ndim == 1:
        got = {k: v[:, None] for k, v in got.items()}
        ref = {k: np.asarray(v)[:, None] for k, v in ref.items() if np.ndim(v) == 1}
        norms = norms[:, None]
    warm = 20
    clipped = np.asarray(ref["hist_scale"]) < 1
    assert_close(got["clip_to"][clipped], ref["threshold"][clipped])
    late = np.zeros_like(clipped)
    late[warm:] = True
    np.testing.assert_allclose(got["clip_to"][~clipped & late], norms[~clipped & late], rtol=1e-6)
    np.testing.assert_allclose(got["threshold"][:warm], 1.0)
    early = np.asarray(ref["scale"])[:warm]
    assert_close(got["clip_to"][:warm], norms[:warm] * early)
    # drytorch starts its statistics on the step after the warm-up sample:
    # from the step after that one, the boundary follows from its pre-step mean/std.
    mu = ref["mean"][warm:-1]
    if kind == "zstat":
        boundary = mu + 2.5 * (ref["std"][warm:-1] + 1e-8)
    else:
        boundary = mu * 1.05
    assert_close(got["threshold"][warm + 1 :], np.where(mu != 0, boundary, np.inf))


@needs_drytorch
@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize(
    "kind, clip",
    [*(("zstat", c) for c in ("max", "mean", "reciprocal")), ("ema", "max"), ("ema", "reciprocal")],
)
def test_matches_drytorch_step_by_step(stream: str, kind: str, clip: str) -> None:
    norms = STREAMS[stream]()
    ref = R.drytorch_reference(norms, criterion=kind, clip=clip)
    criterion = {"zstat": clipjax.zstat_criterion, "ema": clipjax.ema_criterion}[kind]
    got = drive.run(
        clipjax.hist_clip(criterion(clip_fn=FNS[clip]), warmup_clip=TORCH_WARMUP), norms
    )
    assert_matches_reference(got, ref, norms, kind)
    assert_close(got["scale"], ref["scale"])  # the factor applied, the warm-up clip's included
    assert_close(got["applied"], ref["scale"])
    assert_close(got["mean"][20:], ref["mean"][20:])
    if kind == "zstat":
        assert_close(got["std"][20:], ref["std"][20:])


@needs_drytorch
def test_per_param_is_param_hist_clipper() -> None:
    norms = np.stack([R.spikes(seed=1)[0], R.regime_shift(400, seed=2)], axis=1)
    ref = R.drytorch_reference(norms, per_param=True)
    warmup = clipjax.clip_by_global_norm(1.0, eps=1e-6, scope="per_param")
    got = drive.run(clipjax.hist_clip(scope="per_param", warmup_clip=warmup), norms)
    assert_matches_reference(got, ref, norms)
    assert_close(got["applied"], ref["scale"])


@needs_drytorch
def test_no_warmup_clip_and_short_warmup() -> None:
    norms = R.spikes()[0] * 3.0
    ref = R.drytorch_reference(norms, n_warmup_steps=3, warmup_max_norm=None)
    got = drive.run(clipjax.hist_clip(warmup_steps=3, warmup_clip=None), norms)
    assert_close(got["applied"], ref["scale"])
    clipped = ref["hist_scale"] < 1
    assert_close(got["clip_to"][clipped], ref["threshold"][clipped])


@needs_drytorch
def test_ema_mean_clipping_fix() -> None:
    """FIX: drytorch's EMA + mean_clipping zeroes the gradient; clipjax clips to the mean."""
    norms = R.spikes()[0]
    crit = clipjax.ema_criterion(clip_fn=clipjax.mean_clipping)
    ref = R.drytorch_reference(norms, criterion="ema", clip="mean")
    got = drive.run(clipjax.hist_clip(crit, warmup_clip=TORCH_WARMUP), norms)
    fired = np.isfinite(ref["threshold"])
    assert fired.any() and np.all(ref["scale"][fired] == 0.0), "the reference zeroes the gradient"
    before_mean = np.concatenate([[np.nan], got["mean"][:-1]])
    np.testing.assert_allclose(got["clip_to"][fired], before_mean[fired], rtol=1e-6)
    np.testing.assert_allclose(got["applied"][fired] * norms[fired], before_mean[fired], rtol=1e-5)


def test_low_side_fire_reports_threshold_but_does_not_scale() -> None:
    norms = np.r_[R.regime_shift(60)[:30], [0.01]]
    got = drive.run(clipjax.hist_clip(warmup_steps=20), norms)
    assert np.isfinite(got["threshold"][-1]) and got["scale"][-1] == 1.0


def test_nan_is_kept_out_of_statistics_and_warmup_clip() -> None:
    clean = R.spikes()[0]
    tx = clipjax.hist_clip()
    got = drive.run(tx, R.with_nan(clean, at=[5, 70]))
    skip = drive.run(tx, np.delete(clean, [5, 70]))
    np.testing.assert_allclose(got["threshold"][71:], skip["threshold"][69:], rtol=1e-6)
    np.testing.assert_allclose(got["mean"][71:], skip["mean"][69:], rtol=1e-6)
    assert got["nonfinite_count"][-1] == 2 and got["scale"][70] == 1.0
    params = drive.grads_of(jnp.ones(1))
    state = tx.init(params)
    for g in [1.0, np.nan, 2.0]:
        _, state = tx.update(drive.grads_of(jnp.array([g])), state, params)
    inner = clipjax.metrics(state)
    assert int(inner["hist_clip/clip_by_global_norm/global/step"]) == 2


def test_warmup_clip_metrics_are_nested_and_generic_transforms_work() -> None:
    norms = R.constant(30, 4.0)
    fused = drive.run(clipjax.hist_clip(warmup_steps=10), norms)
    generic = drive.run(
        clipjax.hist_clip(warmup_steps=10, warmup_clip=optax.clip_by_global_norm(1.0)), norms
    )
    np.testing.assert_allclose(fused["applied"][:10], 0.25, rtol=1e-6)
    np.testing.assert_allclose(generic["applied"], fused["applied"], rtol=1e-6)
    # hist_clip's own metrics say what the warm-up clip did (issue 45): the scale and
    # the norm the step leaves with; the threshold where the clip reports one.
    for run in (fused, generic):
        np.testing.assert_allclose(run["scale"][:10], 0.25, rtol=1e-5)
        np.testing.assert_allclose(run["clip_to"][:10], 1.0, rtol=1e-5)
        assert run["clipped"][:10].all() and run["clipped_count"][9] == 10
    np.testing.assert_allclose(fused["threshold"][:10], 1.0)
    assert np.isinf(generic["threshold"][:10]).all()  # optax's clip reports none


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: clipjax.zstat_criterion(alpha=0.0), "alpha"),
        (lambda: clipjax.zstat_criterion(z_thresh=-1.0), "z_thresh"),
        (lambda: clipjax.ema_criterion(r_thresh=0.0), "r_thresh"),
        (lambda: clipjax.hist_clip(warmup_steps=-1), "warmup_steps"),
        (lambda: clipjax.hist_clip(criterion="zstat"), "criterion"),
        (lambda: clipjax.hist_clip(warmup_clip=3), "warmup_clip"),
        (lambda: clipjax.hist_clip(scope="bad"), "scope"),
    ],
)
def test_invalid_hyperparameters_name_the_argument(make, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        make()


def test_a_warmup_clip_without_warmup_is_refused() -> None:
    """Issue 37."""
    with pytest.raises(ValueError, match=r"warmup_clip=.* has no effect with warmup_steps=0"):
        clipjax.hist_clip(warmup_steps=0, warmup_clip=clipjax.clip_by_global_norm(1.0))
    clipjax.hist_clip(warmup_steps=0)
    clipjax.hist_clip(warmup_steps=0, warmup_clip=None)


def test_nested_warmup_metrics_reset_after_warmup() -> None:
    """Once the warm-up ends its clip no longer runs: its nested metrics read ``clipped``
    False, ``grad_norm`` 0 and ``scale`` 1, and its counters keep their totals."""
    tx = clipjax.hist_clip(warmup_steps=2, warmup_clip=clipjax.clip_by_global_norm(1.0))
    state = tx.init({"w": jnp.ones(4)})
    update = jax.jit(tx.update)
    nested = lambda state: clipjax.metrics(state, flat=False)["hist_clip"][
        "clip_by_global_norm/global"
    ]
    for g in [0.5, 5.0]:  # warm-up: 0.5 (not clipped), then 5.0 (clipped by the warm-up clip)
        _, state = update({"w": jnp.full(4, g / 2)}, state)
    m = nested(state)
    assert m["clipped"] == 1.0 and m["grad_norm"] == pytest.approx(5.0)
    for g in [1.0, 1.1, 0.9]:
        _, state = update({"w": jnp.full(4, g / 2)}, state)
        m = nested(state)
        assert m["clipped"] == 0.0, "the warm-up clip did not run: clipped must read False"
        assert m["grad_norm"] == 0.0 and m["scale"] == 1.0
        assert m["step"] == 2 and m["count"] == 2  # two warm-up steps, one clipped
        assert m["clipped_count"] == 1 and m["nonfinite_count"] == 0


def test_nested_warmup_metrics_reset_per_group() -> None:
    """per_param: each group's nested metrics reset when that group's warm-up ends."""
    warmup = clipjax.clip_by_global_norm(1.0, scope="per_param")
    tx = clipjax.hist_clip(warmup_steps=2, warmup_clip=warmup, scope="per_param")
    state = tx.init({"a": jnp.ones(4), "b": jnp.ones(4)})
    update = jax.jit(tx.update)
    # "a" is clipped by the warm-up clip on its last warm-up step, "b" on its first.
    for ga, gb in [(0.5, 4.0), (3.0, 0.5), (1.0, 1.0), (1.0, 1.0)]:
        _, state = update({"a": jnp.full(4, ga / 2), "b": jnp.full(4, gb / 2)}, state)
        if ga == gb:  # after the warm-up
            for group in ("a", "b"):
                v = clipjax.metrics(state, flat=False)["hist_clip"][f"clip_by_global_norm/{group}"]
                assert (v["grad_norm"], v["scale"], v["clipped"]) == (0.0, 1.0, 0.0), (group, v)
                assert (v["step"], v["count"], v["clipped_count"]) == (2, 2, 1), (group, v)
