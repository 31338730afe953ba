"""Memory traffic of a clipper in front of adam, in units of gradient bytes (SPEC 7).

Extra "bytes accessed" of ``chain(clipper, adam)`` over ``adam`` alone, from
XLA's ``compiled.cost_analysis()``: a repeatable figure (no timing involved).
A norm-based clipper that reads the gradients once for its norms and fuses its
scalar multiply into adam's elementwise work costs 1.0; AGC also reads the
parameters once, 2.0.

    PYTHONPATH=. .venv/bin/python benchmarks/traffic.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common


def model_params(sizes: tuple[int, ...] = (512, 1024, 1024, 10), dtype: Any = jnp.float32) -> Any:
    """An MLP-shaped parameter tree (kernels and biases) of a few million floats."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        params[f"Dense_{i}"] = {
            "kernel": jnp.ones((fan_in, fan_out), dtype),
            "bias": jnp.ones((fan_out,), dtype),
        }
    return {"params": params}


def bytes_accessed(tx: optax.GradientTransformation, params: Any) -> float:
    """XLA's "bytes accessed" of one jitted ``update`` + ``apply_updates`` step.

    The step is the one the step-time benchmark runs (params and state
    donated), so the two sections measure the same compiled program.
    """
    state = tx.init(params)
    step = jax.jit(common.train_step(tx), donate_argnums=(0, 1))
    compiled = step.lower(params, state, params).compile()
    return float(common.cost(compiled)["bytes accessed"])


def extra_traffic(
    make: Callable[[], optax.GradientTransformation], params: Any, base: Any = None
) -> float:
    """Extra bytes of ``chain(make(), adam)`` over adam, in gradient bytes."""
    grad_bytes = common.tree_bytes(params)
    adam = optax.adam(common.LR)
    base = bytes_accessed(adam, params) if base is None else base
    return (bytes_accessed(optax.chain(make(), adam), params) - base) / grad_bytes


def measure(clippers: Sequence[common.Clipper], params: Any) -> dict[str, Any]:
    """Extra traffic of every clipper on ``params``: ``{name: figure or error}``."""
    base = bytes_accessed(optax.adam(common.LR), params)
    out: dict[str, Any] = {
        "adam_bytes": base,
        "grad_bytes": common.tree_bytes(params),
        "params": common.num_params(params),
        "leaves": len(jax.tree.leaves(params)),
        "rows": {},
    }
    for c in clippers:
        common.log(f"  traffic {c.name}")
        try:
            out["rows"][c.name] = extra_traffic(c.make, params, base)
        except Exception as err:  # one broken clipper must not hide the others
            out["rows"][c.name] = f"{type(err).__name__}: {err}"
    return out


def updates_only(tx: optax.GradientTransformation, params: Any) -> float:
    """Bytes accessed by a step that keeps the new params and drops the optimizer state.

    XLA then removes everything only the state needed (a clipper's metrics),
    which tells the clipping pass's own traffic from its bookkeeping.
    """
    state = tx.init(params)

    def step(p: Any, s: Any, g: Any) -> Any:
        updates, _ = tx.update(g, s, p)
        return optax.apply_updates(p, updates)

    compiled = jax.jit(step).lower(params, state, params).compile()
    return float(common.cost(compiled)["bytes accessed"])


def updates_only_extra(
    makes: dict[str, Callable[[], optax.GradientTransformation]], params: Any
) -> dict[str, float]:
    """``updates_only`` extra traffic over adam's, in gradient bytes, per label."""
    grad_bytes = common.tree_bytes(params)
    base = updates_only(optax.adam(common.LR), params)
    return {
        k: (updates_only(optax.chain(m(), optax.adam(common.LR)), params) - base) / grad_bytes
        for k, m in makes.items()
    }


def from_steptime(steptime: dict[str, Any], adam: str = "adam (no clipping)") -> dict[str, Any]:
    """The traffic table from the programs the step-time section already compiled."""
    rows = steptime["rows"]
    base = rows[adam]["bytes_accessed"]
    grad_bytes = steptime["grad_bytes"]
    out = {
        "adam_bytes": base,
        "grad_bytes": grad_bytes,
        "params": steptime["params"],
        "leaves": steptime["leaves"],
        "rows": {},
    }
    for name, row in rows.items():
        if name != adam and "bytes_accessed" in row:
            out["rows"][name] = (row["bytes_accessed"] - base) / grad_bytes
    for name, err in steptime.get("errors", {}).items():
        out["rows"][name] = err
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="every clipper and scope")
    args = parser.parse_args()
    if args.all:
        clippers, notes = common.registry()
        params = common.params_and_grads(common.transformer_shapes())[0]
        for note in notes:
            print(note)
    else:
        import clipjax

        clippers = [
            common.Clipper(
                "optax.clip_by_global_norm", "global", lambda: optax.clip_by_global_norm(1.0)
            ),
            common.Clipper(
                "clip_by_global_norm", "global", lambda: clipjax.clip_by_global_norm(1.0)
            ),
        ]
        params = model_params()
    result = measure(clippers, params)
    for name, value in result["rows"].items():
        shown = f"{value:6.3f}" if isinstance(value, float) else value
        print(f"{name:45s} {shown}")


if __name__ == "__main__":
    main()
