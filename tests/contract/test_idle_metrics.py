"""The metrics of a step a transform did not run: hist_clip's warm-up clip past its warm-up
reads idle (grad_norm 0, scale 1, not clipped); a clipper in a skipped ``skip_on_spike`` step
reads skipped (grad_norm NaN); both keep thresholds, statistics and counters."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

import clipjax
from clipjax._conditional import idle_metrics


def test_idle_metrics_keeps_thresholds_statistics_and_counters() -> None:
    metrics = {
        "grad_norm": jnp.array([3.0, 4.0]),
        "threshold": jnp.array([2.0, 5.0]),
        "scale": jnp.array([0.5, 1.0]),
        "clipped": jnp.array([True, False]),
        "capped": jnp.array([True, False]),
        "z": jnp.array([2.5, -1.0]),
        "mean": jnp.array([1.0, 1.5]),
        "step": jnp.array([7, 7], jnp.int32),
        "clipped_count": jnp.array([3, 1], jnp.int32),
    }
    idle = idle_metrics(metrics)
    assert {k: v.dtype for k, v in idle.items()} == {k: v.dtype for k, v in metrics.items()}
    for field, value in dict(grad_norm=0.0, scale=1.0, clipped=False, capped=False, z=0.0).items():
        np.testing.assert_array_equal(idle[field], [value, value], err_msg=field)
    for kept in ("threshold", "mean", "step", "clipped_count"):
        np.testing.assert_array_equal(idle[kept], metrics[kept], err_msg=kept)


def test_hist_clips_warmup_clip_reads_idle_after_the_warmup() -> None:
    tx = clipjax.hist_clip(warmup_steps=2, warmup_clip=clipjax.clip_by_global_norm(0.5))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    seen = []
    for _ in range(4):
        _, state = tx.update({"w": jnp.full(3, 2.0)}, state, params)
        m = clipjax.metrics(state)
        seen.append({k.rsplit("/", 1)[1]: float(v) for k, v in m.items() if "/clip_by_" in k})
    # In warm-up the clip ran: norm 2 sqrt(3) clipped to 0.5.
    assert seen[1]["clipped"] == 1.0 and seen[1]["grad_norm"] > 3.4 and seen[1]["scale"] < 0.15
    for after in seen[2:]:
        assert (after["grad_norm"], after["scale"], after["clipped"]) == (0.0, 1.0, 0.0)
        # Its counters stand at the two warm-up steps it ran.
        assert (after["step"], after["clipped_count"]) == (2.0, 2.0)


def test_a_skipped_steps_clipper_reads_skipped_with_its_threshold_standing() -> None:
    inner = clipjax.zclip(warmup_steps=2, name="z")
    tx = clipjax.skip_on_spike(optax.chain(inner, optax.sgd(0.1)), window_size=4, min_history=2)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for scale in (1.0, 1.1, 0.9, 1.0):
        _, state = tx.update({"w": jnp.full(3, scale)}, state, params)
    before = clipjax.metrics(state)
    _, state = tx.update({"w": jnp.full(3, 1000.0)}, state, params)
    after = clipjax.metrics(state)
    assert bool(after["skip_on_spike/global/skipped"])
    assert np.isnan(float(after["z/global/grad_norm"])) and bool(after["z/global/skipped"])
    assert float(after["z/global/scale"]) == 1.0 and not bool(after["z/global/clipped"])
    assert not bool(before["z/global/skipped"])
    assert float(after["z/global/threshold"]) == float(before["z/global/threshold"])
