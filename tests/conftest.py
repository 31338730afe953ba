"""Shared fixtures: a small MLP-shaped params tree, gradient generators, x64."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Marks the long runs slow at collection (the lists are in tests/slow_marks.py).
from tests.slow_marks import pytest_collection_modifyitems  # noqa: F401

# Deterministic property tests: the same examples on every run and machine, no
# per-example deadline (the first call of a jitted function compiles).
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=50,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=50)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def version_of(module: Any) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a module's ``__version__``."""
    return tuple(int(part) for part in module.__version__.split(".")[:3] if part.isdigit())


Params = dict[str, Any]
GradFn = Callable[..., Params]

# (in_features, out_features) of each Dense layer of the reference MLP.
MLP_LAYERS = ((4, 8), (8, 3))


def mlp_params(
    seed: int = 0, layers: tuple[tuple[int, int], ...] = MLP_LAYERS, dtype: Any = jnp.float32
) -> Params:
    """A flax-linen-shaped MLP params tree: ``{"params": {"Dense_i": {kernel, bias}}}``."""
    key = jax.random.PRNGKey(seed)
    dense = {}
    for i, (n_in, n_out) in enumerate(layers):
        key, sub = jax.random.split(key)
        dense[f"Dense_{i}"] = {
            "kernel": (jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in)).astype(dtype),
            "bias": jnp.zeros((n_out,), dtype),
        }
    return {"params": dense}


def random_grads(params: Params, seed: int = 0, scale: float = 1.0) -> Params:
    """Gaussian gradients shaped and typed like ``params``, times ``scale``."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    grads = [
        (scale * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype)
        for k, leaf in zip(keys, leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, grads)


def grad_stream(
    params: Params,
    steps: int,
    seed: int = 0,
    spikes: dict[int, float] | None = None,
    nonfinite: dict[int, float] | None = None,
) -> Iterator[Params]:
    """Yields ``steps`` gradient trees of roughly constant norm.

    Args:
      params: the tree whose shapes and dtypes the gradients take.
      steps: how many gradients to yield.
      seed: base seed; step ``i`` uses ``seed + i``.
      spikes: ``{step: factor}``, gradients multiplied by ``factor`` at ``step``.
      nonfinite: ``{step: value}``, the first leaf's first element set to
        ``value`` (``nan`` or ``inf``) at ``step``.
    """
    spikes = spikes or {}
    nonfinite = nonfinite or {}
    for i in range(steps):
        grads = random_grads(params, seed + i, spikes.get(i, 1.0))
        if i in nonfinite:
            leaves, treedef = jax.tree_util.tree_flatten(grads)
            first = leaves[0]
            leaves[0] = first.reshape(-1).at[0].set(nonfinite[i]).reshape(first.shape)
            grads = jax.tree_util.tree_unflatten(treedef, leaves)
        yield grads


@pytest.fixture
def params() -> Params:
    """A small two-layer MLP params tree (float32)."""
    return mlp_params()


@pytest.fixture
def grads(params: Params) -> Params:
    """One gradient tree shaped like ``params``."""
    return random_grads(params, seed=1)


@pytest.fixture
def make_grads() -> Callable[..., Params]:
    """``make_grads(params, seed=0, scale=1.0)``: Gaussian gradients like ``params``."""
    return random_grads


@pytest.fixture
def make_grad_stream() -> Callable[..., Iterator[Params]]:
    """``make_grad_stream(params, steps, seed=0, spikes=None, nonfinite=None)``."""
    return grad_stream


@pytest.fixture
def x64() -> Iterator[None]:
    """Enables ``jax_enable_x64`` for one test and restores the previous value."""
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
