"""A small donated training step compiled for a transform, and what its HLO holds:
full-size copies and XLA's bytes accessed (repeatable figures a test may assert)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax


def full_size_copies(hlo: str, shapes: set[tuple[int, ...]]) -> int:
    """The ``copy`` instructions of compiled HLO text whose shape is one of ``shapes``."""
    count = 0
    for line in hlo.splitlines():
        match = re.search(r"= [a-z0-9]+\[([\d,]*)\][^ ]* copy\(", line)
        if match and tuple(int(x) for x in match.group(1).split(",") if x) in shapes:
            count += 1
    return count


@contextlib.contextmanager
def ordinary_path() -> Any:
    """Compiles what an ordinary step runs: the overflow-safe norms' recompute
    (``clipjax._grouping.rescued``, a ``lax.cond`` taken only when a float32 sum of
    squares overflows) left out. XLA's cost analysis counts both branches of a
    conditional, so a step's static bytes include that second read of the leaves
    although no ordinary step performs it; a test of "one read" measures without it
    (tests/contract/test_overflow.py tests the recompute itself)."""
    from clipjax import _grouping

    original = _grouping.rescued
    _grouping.rescued = lambda norms, recompute: norms
    try:
        yield
    finally:
        _grouping.rescued = original


def full_size_conditionals(hlo: str, shapes: set[tuple[int, ...]]) -> int:
    """The ``conditional`` instructions of compiled HLO text with an operand or result of
    one of ``shapes`` (a conditional route around an optimizer; the overflow-safe
    norms' scalar-predicate recompute returns norms only)."""
    count = 0
    for line in hlo.splitlines():
        if " conditional(" not in line:
            continue
        head = line.split(" conditional(")[0]
        dims = re.findall(r"\[([\d,]*)\]", head)
        found = {tuple(int(x) for x in d.split(",") if x) for d in dims}
        count += bool(found & shapes)
    return count


def compiled_train_step(tx: optax.GradientTransformation) -> Any:
    """A donated training step: gradients of a small regression, update, apply."""
    params = {f"layer{i}": {"w": jnp.full((64, 64), 0.01), "b": jnp.zeros(64)} for i in range(4)}
    x = jnp.ones((8, 64))

    def loss_fn(p: Any) -> jax.Array:
        h = x
        for layer in p.values():
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean(h**2)

    def step(p: Any, state: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = tx.update(grads, state, p, value=loss)
        return optax.apply_updates(p, updates), state

    traced = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params))
    return traced.compile(), 4 * sum(v.size for v in jax.tree.leaves(params))


def bytes_accessed(compiled: Any) -> float:
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["bytes accessed"]
