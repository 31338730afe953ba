"""clip_by_global_norm (lucid/torch rule, p-norms) against optax and float64 NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax


def grads(seed: int = 0, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "a": jnp.asarray(rng.normal(size=(5, 3)) * scale, jnp.float32),
        "b": {"c": jnp.asarray(rng.normal(size=(7,)) * scale, jnp.float32)},
    }


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_equals_optax_with_eps_zero(max_norm: float) -> None:
    g = grads(scale=3.0)
    tx = clipjax.clip_by_global_norm(max_norm, eps=0.0)
    got, state = jax.jit(tx.update)(g, tx.init(g))
    want, _ = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    m = clipjax.metrics(state)
    np.testing.assert_allclose(
        float(m["clip_by_global_norm/global/grad_norm"]), float(optax.tree.norm(g)), rtol=1e-6
    )


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, -0.5, 1e3])
def test_p_norm_rule_matches_float64(p: float, max_norm: float) -> None:
    g = grads(1, scale=2.0)
    flat = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)])
    norm = np.linalg.norm(flat, ord=p)
    limit = abs(max_norm)
    scale = limit / (norm + 1e-7) if norm > limit else 1.0  # lucid's rule
    tx = clipjax.clip_by_global_norm(max_norm, norm_type=p)
    got, state = tx.update(g, tx.init(g))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(g)):
        np.testing.assert_allclose(x, np.asarray(y, np.float64) * scale, rtol=2e-6)
    m = clipjax.metrics(state)
    np.testing.assert_allclose(float(m["clip_by_global_norm/global/grad_norm"]), norm, rtol=2e-6)
    assert bool(m["clip_by_global_norm/global/clipped"]) == (norm > limit)


def test_nonfinite_norm_passes_unchanged_and_is_counted() -> None:
    g = {"w": jnp.array([1.0, jnp.nan, 3.0])}
    tx = clipjax.clip_by_global_norm(1.0)
    out, state = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(g["w"]))
    m = clipjax.metrics(state)
    assert int(m["clip_by_global_norm/global/nonfinite_count"]) == 1
    assert float(m["clip_by_global_norm/global/scale"]) == 1.0
    assert int(m["clip_by_global_norm/global/count"]) == 0


def test_counters_accumulate() -> None:
    tx = clipjax.clip_by_global_norm(1.0)
    g = {"w": jnp.array([3.0, 4.0])}
    state = tx.init(g)
    for x in [0.1, 10.0, 10.0]:
        _, state = tx.update({"w": g["w"] * x}, state)
    m = clipjax.metrics(state)
    assert int(m["clip_by_global_norm/global/step"]) == 3
    assert int(m["clip_by_global_norm/global/clipped_count"]) == 2


def test_state_is_reachable_with_tree_get() -> None:
    g = {"w": jnp.ones(2)}
    tx = optax.chain(clipjax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = tx.init(g)
    found = optax.tree_utils.tree_get(state, "ClipByGlobalNormState")
    assert isinstance(found, clipjax.ClipByGlobalNormState)


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"norm_type": 0.0}, "norm_type"),
        ({"norm_type": "fro"}, "norm_type"),
        ({"eps": -1.0}, "eps"),
        ({"max_norm": float("nan")}, "max_norm"),
    ],
)
def test_invalid_hyperparameters(kwargs: dict, arg: str) -> None:
    kwargs = {"max_norm": 1.0} | kwargs
    with pytest.raises(ValueError, match=arg):
        clipjax.clip_by_global_norm(**kwargs)


def test_global_norm_matches_optax() -> None:
    g = grads(2)
    np.testing.assert_allclose(float(clipjax.global_norm(g)), float(optax.tree.norm(g)), rtol=1e-6)
    np.testing.assert_allclose(
        float(clipjax.global_norm(g, norm_type=float("inf"))),
        max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g)),
    )
