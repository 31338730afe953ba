"""zclip against the ``zclip`` package itself, and its FIX for non-finite norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax
from tests import drive
from tests import references as R

# Slow: next to the zclip package's traces (torch, `make test-all` installs it); the
# clipper's own tests (test_start.py, test_scale_free.py, test_nonfinite.py) stay fast.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not R.have_zclip(), reason="zclip/torch not installed: pip install torch==2.13.0 zclip"
    ),
]

STREAMS = {
    "spikes": lambda: R.spikes()[0],
    "regime_shift": lambda: R.regime_shift(),
    "constant": lambda: R.constant(),
}
CONFIGS = [
    {},
    {"max_grad_norm": None},
    {"mode": "percentile", "max_grad_norm": None},
    {"clip_option": "mean", "max_grad_norm": 5.0},
    {"skip_update_on_spike": True, "max_grad_norm": None},
    {"alpha": 0.9, "z_thresh": 2.0, "clip_factor": 0.7, "warmup_steps": 5, "max_grad_norm": None},
]
RTOL = 3e-5  # float32 clipjax against the reference in float64


@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default"
)
def test_matches_zclip_step_by_step(stream: str, config: dict) -> None:
    norms = STREAMS[stream]()
    ref = R.zclip_reference(norms, **config)
    got = drive.run(clipjax.zclip(**config), norms)
    warm = config.get("warmup_steps", 25)
    # The reference's threshold is the norm it clips to: clipjax's clip_to
    # (after warm-up; during it the reference reports the cap).
    drive.assert_close(got["clip_to"][warm:], ref["threshold"][warm:])
    # clipjax's threshold is the boundary above which a step is clipped, from
    # the statistics before the step, capped (the cap itself during warm-up).
    cap = config.get("max_grad_norm", 1.0)
    cap = np.inf if cap is None else cap
    z_thresh, eps = config.get("z_thresh", 2.5), 1e-6
    mean, std = ref["mean"][warm - 1 : -1], ref["std"][warm - 1 : -1]
    if config.get("mode") == "percentile":
        boundary = mean + z_thresh * std
    else:
        boundary = mean + z_thresh * (std + eps)
    drive.assert_close(got["threshold"][warm:], np.minimum(boundary, cap))
    drive.assert_close(got["threshold"][:warm], np.full(warm, cap))
    drive.assert_close(got["scale"], ref["scale"])
    drive.assert_close(got["applied"], ref["scale"])
    drive.assert_close(got["mean"][warm:], ref["mean"][warm:])
    drive.assert_close(got["std"][warm:], ref["std"][warm:])
    if stream == "spikes":
        assert got["clipped"].sum() > 0


def test_spike_is_cut_below_the_running_level() -> None:
    norms, at = R.spikes()
    got = drive.run(clipjax.zclip(max_grad_norm=None), norms)
    for i in at:
        assert got["applied"][i] * norms[i] < 3 * np.median(norms)


def test_nan_never_enters_the_statistics() -> None:
    """FIX: zclip is poisoned for good by one NaN; here later steps equal a run without it."""
    clean = R.spikes()[0]
    dirty = R.with_nan(clean, at=70)
    tx = clipjax.zclip(max_grad_norm=None)
    got = drive.run(tx, dirty)
    skip = drive.run(tx, np.delete(clean, 70))
    np.testing.assert_allclose(got["threshold"][71:], skip["threshold"][70:], rtol=1e-6)
    np.testing.assert_allclose(got["mean"][71:], skip["mean"][70:], rtol=1e-6)
    assert got["scale"][70] == 1.0 and got["nonfinite_count"][-1] == 1
    assert got["count"][-1] == len(clean) - 1
    ref = R.zclip_reference(dirty, max_grad_norm=None)
    assert np.isnan(ref["mean"][-1]), "the reference would have been poisoned"
    assert np.isfinite(got["mean"]).all() and np.isfinite(got["std"]).all()


def test_nan_during_warmup_is_skipped() -> None:
    clean = R.constant(60, 2.0)
    got = drive.run(clipjax.zclip(warmup_steps=10), R.with_nan(clean, at=3))
    assert got["count"][10] == 10  # the NaN step did not count towards the warm-up set
    np.testing.assert_allclose(got["mean"][-1], 2.0, rtol=1e-6)


def test_threshold_during_warmup_is_the_cap() -> None:
    got = drive.run(clipjax.zclip(warmup_steps=5, max_grad_norm=3.0), R.constant(8, 4.0))
    np.testing.assert_allclose(got["threshold"][:5], 3.0)
    np.testing.assert_allclose(got["applied"][:5], 3.0 / (4.0 + 1e-6), rtol=1e-6)
    got = drive.run(clipjax.zclip(warmup_steps=5, max_grad_norm=None), R.constant(8, 4.0))
    assert np.isinf(got["threshold"][:5]).all() and (got["scale"][:5] == 1).all()


def test_per_param_groups_are_independent() -> None:
    a, b = R.spikes(seed=1)[0], R.regime_shift(400, seed=2)
    both = drive.run(clipjax.zclip(scope="per_param", max_grad_norm=None), np.stack([a, b], 1))
    alone = drive.run(clipjax.zclip(max_grad_norm=None), b)
    np.testing.assert_allclose(both["threshold"][:, 1], alone["threshold"], rtol=1e-6)


_NO_EFFECT = "=.* has no effect with mode="


@pytest.mark.parametrize(
    "kwargs, match",
    [
        *[({k: v}, k) for k, v in [("alpha", 1.0), ("z_thresh", 0.0), ("max_grad_norm", -1.0),
                                   ("warmup_steps", 0), ("mode", "x"), ("clip_option", "x"),
                                   ("scope", "nope")]],
        # issue 37: passed at their default values these used to be accepted silently
        *[({"mode": "percentile", k: v}, k + _NO_EFFECT) for k, v in
          [("clip_option", "adaptive_scaling"), ("clip_option", "mean"), ("clip_factor", 1.0),
           ("clip_factor", 0.7)]],
        ({"clip_option": "mean", "clip_factor": 1.0}, "clip_factor" + _NO_EFFECT),
    ],
)  # fmt: skip
def test_invalid_hyperparameters_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        clipjax.zclip(**kwargs)


def test_clip_option_and_factor_default_to_adaptive_scaling_at_one() -> None:
    g = lambda x: {"w": jnp.array([x])}
    runs = []
    for kw in ({}, {"clip_option": "adaptive_scaling", "clip_factor": 1.0}):
        tx = clipjax.zclip(warmup_steps=3, **kw)
        state, outs = tx.init(g(0.0)), []
        for x in [0.1, 0.11, 0.09, 0.1, 0.5]:
            out, state = tx.update(g(x), state)
            outs.append(float(out["w"][0]))
        runs.append(outs)
    assert runs[0] == runs[1] and runs[0][-1] < 0.5
    clipjax.zclip(mode="percentile")  # accepted without them


def test_warmup_statistics_from_running_sums_do_not_cancel() -> None:
    """The warm-up sample is running sums (no [groups, warmup_steps] buffer): its mean and
    population variance still match the two-pass float64 values where a sum of squares
    would cancel (a spread of 1e-3 on a level of 1e3)."""
    rng = np.random.default_rng(0)
    norms = (1e3 + 1e-3 * rng.standard_normal(20)).astype(np.float32)
    tx = clipjax.zclip(warmup_steps=len(norms), max_grad_norm=None)
    state = tx.init({"w": jnp.zeros(1)})
    assert all(np.shape(x) == (1,) for x in jax.tree.leaves((state.mean, state.var, state.sample)))
    for x in norms:
        _, state = tx.update({"w": jnp.array([x])}, state)
    m = clipjax.metrics(state)
    reference = norms.astype(np.float64)
    np.testing.assert_allclose(m["zclip/global/mean"], reference.mean(), rtol=1e-7)
    np.testing.assert_allclose(m["zclip/global/std"], reference.std(), rtol=1e-2)
