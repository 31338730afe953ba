"""clip_by_global_norm (lucid/torch rule, p-norms) against optax and float64 NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

PREFIX = "clip_by_global_norm/global/"


def grads(seed: int = 0, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    a, c = rng.normal(size=(5, 3)) * scale, rng.normal(size=(7,)) * scale
    return {"a": jnp.asarray(a, jnp.float32), "b": {"c": jnp.asarray(c, jnp.float32)}}


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_equals_optax_with_eps_zero(max_norm: float) -> None:
    g = grads(scale=3.0)
    tx = clipjax.clip_by_global_norm(max_norm, eps=0.0)
    got, state = jax.jit(tx.update)(g, tx.init(g))
    want, _ = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    norm = float(clipjax.metrics(state)[PREFIX + "grad_norm"])
    np.testing.assert_allclose(norm, float(optax.tree.norm(g)), rtol=1e-6)


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
    np.testing.assert_allclose(float(m[PREFIX + "grad_norm"]), norm, rtol=2e-6)
    assert bool(m[PREFIX + "clipped"]) == (norm > limit)


def test_nonfinite_norm_passes_unchanged_and_is_counted() -> None:
    g = {"w": jnp.array([1.0, jnp.nan, 3.0])}
    tx = clipjax.clip_by_global_norm(1.0)
    out, state = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(g["w"]))
    m = clipjax.metrics(state)
    assert int(m[PREFIX + "nonfinite_count"]) == 1
    assert float(m[PREFIX + "scale"]) == 1.0 and int(m[PREFIX + "count"]) == 0


def test_counters_accumulate() -> None:
    tx = clipjax.clip_by_global_norm(1.0)
    g = {"w": jnp.array([3.0, 4.0])}
    state = tx.init(g)
    for x in [0.1, 10.0, 10.0]:
        _, state = tx.update({"w": g["w"] * x}, state)
    m = clipjax.metrics(state)
    assert int(m[PREFIX + "step"]) == 3 and int(m[PREFIX + "clipped_count"]) == 2


def test_state_is_reachable_with_tree_get() -> None:
    state = optax.chain(clipjax.clip_by_global_norm(1.0), optax.adam(1e-3)).init({"w": jnp.ones(2)})
    found = optax.tree_utils.tree_get(state, "ClipByGlobalNormState")
    assert isinstance(found, clipjax.ClipByGlobalNormState)


@pytest.mark.parametrize(
    "kwargs", [{"norm_type": 0.0}, {"norm_type": "fro"}, {"eps": -1.0}, {"max_norm": float("nan")}]
)
def test_invalid_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        clipjax.clip_by_global_norm(**({"max_norm": 1.0} | kwargs))


def test_global_norm_matches_optax() -> None:
    g = grads(2)
    np.testing.assert_allclose(float(clipjax.global_norm(g)), float(optax.tree.norm(g)), rtol=1e-6)
    inf_norm = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g))
    np.testing.assert_allclose(float(clipjax.global_norm(g, norm_type=float("inf"))), inf_norm)
