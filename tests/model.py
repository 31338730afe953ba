"""The parameter trees the tests feed the transforms, their data and their gradients.

* :func:`mlp_params`: a two-layer MLP whose dimensions divide by 8 (so that FSDP
  can shard every leaf), with :func:`loss_fn` and regression :func:`batches`
  (a gradient spike at step 5) and :func:`train_step`;
* :func:`contract_params` and :func:`grads_at`: the contract tests' tree (a
  ``None`` leaf, a loose vector) and a deterministic gradient per step;
* :func:`random_grads` and :func:`grad_stream`: Gaussian gradients shaped like
  any tree (``tests/conftest.py`` serves them as fixtures).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = dict[str, Any]

IN, HIDDEN, OUT = 8, 16, 8
BATCH = 32
SPIKES = {5: 30.0}  # step -> factor on the targets: a gradient spike


def mlp_params(seed: int = 0) -> Params:
    """``{"params": {"Dense_0": {kernel, bias}, "Dense_1": {kernel, bias}}}``, flax
    linen's layout (``Dense_0``'s bias 0.1, ``Dense_1``'s zero)."""
    k0, k1 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "params": {
            "Dense_0": {
                "kernel": jax.random.normal(k0, (IN, HIDDEN)) / np.sqrt(IN),
                "bias": jnp.full((HIDDEN,), 0.1, jnp.float32),
            },
            "Dense_1": {
                "kernel": jax.random.normal(k1, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
                "bias": jnp.zeros((OUT,)),
            },
        }
    }


def mlp_apply(params: Any, x: jax.Array) -> jax.Array:
    p = params["params"]
    h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((mlp_apply(params, x) - y) ** 2)


def batches(
    steps: int, seed: int = 0, spikes: dict[int, float] | None = SPIKES
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``steps`` regression batches ``(x [BATCH, IN], y [BATCH, OUT])``, with ``spikes``."""
    spikes = spikes or {}
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(IN, OUT)).astype(np.float32)
    for step in range(steps):
        x = rng.normal(size=(BATCH, IN)).astype(np.float32)
        y = np.sin(x @ w) * np.float32(spikes.get(step, 1.0))
        yield x, y.astype(np.float32)


def train_step(tx: optax.GradientTransformation, constrain: Callable[[Any], Any] | None = None):
    """``(params, opt_state, batch) -> (params, opt_state, updates)`` for one step.

    ``constrain`` is applied to the gradients (e.g. a sharding constraint).
    """

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        grads = jax.grad(loss_fn)(params, batch)
        if constrain is not None:
            grads = constrain(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, updates

    return step


def contract_params(dtype: Any = jnp.float32) -> Params:
    """Two dense layers (the second without a bias: a ``None`` leaf) and a loose vector."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "params": {
            "Dense_0": {
                "kernel": jax.random.normal(k1, (6, 5), dtype),
                "bias": jnp.zeros((5,), dtype),
            },
            "Dense_1": {"kernel": jax.random.normal(k2, (5, 3), dtype), "bias": None},
            "scale": jax.random.normal(k3, (3,), dtype),
        }
    }


def grads_at(params: Any, step: int, spike: int | None = 6, factor: float = 30.0) -> Any:
    """Step ``step``'s gradients: ``params`` times a factor that wanders by 10%, plus
    0.01, and ``factor`` times more at step ``spike``; in the params' dtypes."""
    scale = 1.0 + 0.1 * np.sin(step) + (factor if step == spike else 0.0)
    return jax.tree.map(lambda p: (p * scale + 0.01).astype(p.dtype), params)


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
