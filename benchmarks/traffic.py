"""Memory traffic of a clipper in front of adam, in units of gradient bytes (SPEC 7).

Extra "bytes accessed" of ``chain(clipper, adam)`` over ``adam`` alone, from
XLA's ``compiled.cost_analysis()``; a repeatable figure (no timing involved).

    python benchmarks/traffic.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax


def model_params(sizes: tuple[int, ...] = (512, 1024, 1024, 10), dtype: Any = jnp.float32) -> Any:
    """An MLP-shaped parameter tree (kernels and biases) of a few million floats."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"Dense_{i}"] = {
            "kernel": jnp.ones((fan_in, fan_out), dtype),
            "bias": jnp.ones((fan_out,), dtype),
        }
    return {"params": params}


def bytes_accessed(tx: optax.GradientTransformation, params: Any) -> float:
    state = tx.init(params)

    def step(grads: Any, state: Any, params: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    compiled = jax.jit(step).lower(params, state, params).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0]
    return float(cost["bytes accessed"])


def extra_traffic(
    make: Callable[[], optax.GradientTransformation], params: Any, base: Any = None
) -> float:
    """Extra bytes of ``chain(make(), adam)`` over adam, in gradient bytes."""
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    adam = optax.adam(1e-3)
    base = bytes_accessed(adam, params) if base is None else base
    return (bytes_accessed(optax.chain(make(), adam), params) - base) / grad_bytes


def main() -> None:
    import clipjax

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    params = model_params()
    base = bytes_accessed(optax.adam(1e-3), params)
    rows = {
        "optax.clip_by_global_norm(1.0)": lambda: optax.clip_by_global_norm(1.0),
        "clipjax.clip_by_global_norm(1.0)": lambda: clipjax.clip_by_global_norm(1.0),
    }
    for label, make in rows.items():
        print(f"{label:45s} {extra_traffic(make, params, base):6.3f}")


if __name__ == "__main__":
    main()
