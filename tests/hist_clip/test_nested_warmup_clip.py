"""hist_clip's warm-up clip after the warm-up: its nested metrics read idle.

Once a group's warm-up ends the warm-up clip no longer runs, so its nested
metrics (``hist_clip/clip_by_global_norm/{group}/...``) say so: ``clipped`` False,
``grad_norm`` 0 and ``scale`` 1, while its counters keep their totals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import clipjax


def test_nested_warmup_metrics_reset_after_warmup() -> None:
    tx = clipjax.hist_clip(warmup_steps=2, warmup_clip=clipjax.clip_by_global_norm(1.0))
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    nested = "clip_by_global_norm/global"  # the warm-up clip's group, inside hist_clip's
    # Warm-up: 0.5 (not clipped), then 5.0 (clipped by the warm-up clip).
    for g in [0.5, 5.0]:
        _, state = update({"w": jnp.full(4, g / 2)}, state)
    m = clipjax.metrics(state, flat=False)["hist_clip"][nested]
    assert m["clipped"] == 1.0 and m["grad_norm"] == pytest.approx(5.0)
    for g in [1.0, 1.1, 0.9]:
        _, state = update({"w": jnp.full(4, g / 2)}, state)
        m = clipjax.metrics(state, flat=False)["hist_clip"][nested]
        assert m["clipped"] == 0.0, "the warm-up clip did not run: clipped must read False"
        assert m["grad_norm"] == 0.0 and m["scale"] == 1.0
        # Counters keep their totals: two warm-up steps, one clipped.
        assert m["step"] == 2 and m["count"] == 2
        assert m["clipped_count"] == 1 and m["nonfinite_count"] == 0


def test_nested_warmup_metrics_reset_per_group() -> None:
    """per_param: each group's nested metrics reset when that group's warm-up ends."""
    tx = clipjax.hist_clip(
        warmup_steps=2,
        warmup_clip=clipjax.clip_by_global_norm(1.0, scope="per_param"),
        scope="per_param",
    )
    params = {"a": jnp.ones(4), "b": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    # "a" is clipped by the warm-up clip on its last warm-up step, "b" on its first.
    for ga, gb in [(0.5, 4.0), (3.0, 0.5)]:
        _, state = update({"a": jnp.full(4, ga / 2), "b": jnp.full(4, gb / 2)}, state)
    for _ in range(2):
        _, state = update({"a": jnp.full(4, 0.5), "b": jnp.full(4, 0.5)}, state)
        m = clipjax.metrics(state, flat=False)["hist_clip"]
        for group in ("a", "b"):
            v = m[f"clip_by_global_norm/{group}"]
            assert (v["grad_norm"], v["scale"], v["clipped"]) == (0.0, 1.0, 0.0), (group, v)
            assert (v["step"], v["count"], v["clipped_count"]) == (2, 2, 1), (group, v)
