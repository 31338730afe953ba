"""The gradient and loss streams the skip_on_spike tests run, and a compiled run of them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

WINDOW, MIN_HISTORY, SIGMA, STEPS = 16, 8, 4.0, 60
# The rule the tests build: skip_on_spike(inner, **RULE).
RULE = dict(window_size=WINDOW, min_history=MIN_HISTORY, sigma=SIGMA)
SHAPES = {"w": (4, 3), "b": (3,)}

# --------------------------------------------------------------------------- streams


def directions(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random float32 trees of global norm 1 (in float64)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tree = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
        norm = np.sqrt(sum(np.sum(v**2) for v in tree.values()))
        out.append({k: (v / norm).astype(np.float32) for k, v in tree.items()})
    return out


def make_stream(case: str, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    """Gradients (float32 trees) and losses of ``STEPS`` steps for one scenario."""
    rng = np.random.default_rng(100 + seed)
    norms = 1.0 + 0.1 * rng.standard_normal(STEPS)
    losses = 2.0 - 0.005 * np.arange(STEPS) + 0.05 * rng.standard_normal(STEPS)
    bad_grads: dict[int, float] = {}
    if case == "loss_spike":
        losses[[25, 40]] = [10.0, 2.6]
    elif case == "norm_spike":
        norms[[4, 25, 41]] = [30.0, 20.0, 2.0]  # step 4: gate still closed, taken
    elif case == "burst":
        norms[25:29] = 20.0
    elif case == "both":
        norms[[25, 30]] = [20.0, 10.0]
        losses[[25, 35]] = [10.0, 8.0]
    elif case == "nan_loss":
        losses[[3, 28, 29, 50]] = [np.nan, np.nan, np.inf, -np.inf]
    elif case == "nan_grad":
        bad_grads = {2: np.nan, 30: np.nan, 31: np.inf}
    elif case == "shift":
        norms[30:] *= 10.0
        losses[30:] += 5.0
    elif case != "clean":
        raise ValueError(case)
    grads = [
        {k: v * np.float32(n) for k, v in d.items()} for d, n in zip(directions(STEPS, seed), norms)
    ]
    for t, bad in bad_grads.items():
        grads[t]["w"][0, 0] = bad
    return grads, [float(np.float32(x)) for x in losses]


def norm64(tree: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in tree.values())))


# --------------------------------------------------------------------------- runs


def run(
    tx: optax.GradientTransformation,
    grads: list[Any],
    values: list[float] | None,
    params: Any = None,
) -> list[tuple[Any, Any]]:
    """``(updates, state)`` after every step, on the host; one compiled step."""
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()} if params is None else params
    state = tx.init(params)
    if values is None:
        step = jax.jit(lambda u, s: tx.update(u, s, params))
    else:
        step = jax.jit(lambda u, s, v: tx.update(u, s, params, value=v))
    out = []
    for t, g in enumerate(grads):
        args = (g, state) if values is None else (g, state, jnp.float32(values[t]))
        updates, state = step(*args)
        out.append(jax.device_get((updates, state)))
    assert step._cache_size() == 1
    return out


def held(window: np.ndarray, seen: int) -> list[float]:
    """The values in a ring buffer, oldest first."""
    size = len(window)
    if seen <= size:
        return list(window[:seen])
    start = seen % size
    return list(np.concatenate([window[start:], window[:start]]))


def tree_equal(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y, equal_nan=True)
        for x, y in zip(la, lb)
    )
