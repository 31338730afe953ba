"""zclip on a non-finite step (issue 12): the gradient passes unchanged (scale 1, counted),
the statistics are those before it, and ``threshold`` reports the spike boundary they set
(capped by ``max_grad_norm``), not a NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax


@pytest.mark.parametrize("mode", ["zscore", "percentile"])
@pytest.mark.parametrize("max_grad_norm", [100.0, 1.05])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_step_reports_spike_boundary(mode: str, max_grad_norm: float, bad: float) -> None:
    z_thresh = 2.5
    tx = clipjax.zclip(warmup_steps=3, z_thresh=z_thresh, max_grad_norm=max_grad_norm, mode=mode)
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in [1.0, 1.2, 0.9, 1.1, 0.95]:  # 4 entries of g / 2: norm g
        _, state = update({"w": jnp.full(4, g / 2)}, state)
    kept = clipjax.metrics(state, flat=False)["zclip"]["global"]
    grads = {"w": jnp.full(4, bad)}
    out, state = update(grads, state)
    m = clipjax.metrics(state, flat=False)["zclip"]["global"]
    expected = min(kept["mean"] + z_thresh * kept["std"], max_grad_norm)
    assert np.isfinite(m["threshold"]), f"threshold on a {bad} step is {m['threshold']}"
    np.testing.assert_allclose(m["threshold"], expected, rtol=1e-5)
    assert m["mean"] == kept["mean"] and m["std"] == kept["std"]
    assert m["scale"] == 1.0 and m["nonfinite_count"] == 1.0
    assert not np.isfinite(np.asarray(out["w"])).any()
