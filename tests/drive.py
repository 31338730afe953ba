"""Run a clipjax transform over a sequence of gradient norms, as the references are run.

Each step's gradient is ``norm * u`` with ``u`` a fixed unit vector whose entries
are +-0.5 (exact in binary), so the group norm equals the given norm. Groups
(``[steps, groups]`` input) become leaves ``g0, g1, ...`` of one dict. The whole
sequence runs in one ``lax.scan``; metrics come back as numpy arrays
``[steps]`` (or ``[steps, groups]``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax
from clipjax._metrics import state_fields

UNIT = np.array([0.5, -0.5, 0.5, -0.5])


def grads_of(norms: jax.Array, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    unit = jnp.asarray(UNIT, dtype)
    return {f"g{i}": (norms[i] * unit).astype(dtype) for i in range(norms.shape[0])}


def runner(tx: optax.GradientTransformation, groups: int = 1, dtype: Any = jnp.float32) -> Any:
    """A compiled ``[steps, groups] norms -> (metrics, applied)`` function for ``tx``.

    Built once per transform and group count, so property tests that feed many
    sequences of one length compile once.
    """
    params = grads_of(jnp.ones(groups), dtype)
    state0 = tx.init(params)

    def step(state: Any, row: jax.Array) -> Any:
        grads = grads_of(row.astype(dtype), dtype)
        out, state = tx.update(grads, state, params)
        before = jnp.stack([jnp.linalg.norm(g.astype(jnp.float32)) for g in grads.values()])
        after = jnp.stack([jnp.linalg.norm(o.astype(jnp.float32)) for o in out.values()])
        applied = jnp.where(before > 0, after / jnp.where(before > 0, before, 1.0), 1.0)
        identical = jnp.stack([jnp.all(o == g) for g, o in zip(grads.values(), out.values())])
        return state, ({**state_fields(state), "identical": identical}, applied)

    return jax.jit(lambda seq: jax.lax.scan(step, state0, seq)[1])


def run(
    tx: optax.GradientTransformation,
    norms: np.ndarray,
    dtype: Any = jnp.float32,
    compiled: Any = None,
) -> dict[str, np.ndarray]:
    """Metrics of ``tx`` per step (post-step values), plus the measured ``applied`` scale."""
    norms = np.asarray(norms, np.float64)
    two_d = norms.ndim == 2
    seq = norms if two_d else norms[:, None]
    compiled = compiled or runner(tx, seq.shape[1], dtype)
    metrics, applied = compiled(jnp.asarray(seq, dtype))
    out = {k: np.asarray(v) for k, v in metrics.items()}
    out["applied"] = np.asarray(applied)
    if not two_d:
        out = {k: v[:, 0] for k, v in out.items()}
    return out


RTOL = 3e-5  # float32 clipjax against the references in float64


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL, atol: float = 1e-7) -> None:
    """Same finite/non-finite pattern, and close where both are finite."""
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    both = np.isfinite(want)
    np.testing.assert_allclose(got[both], want[both], rtol=rtol, atol=atol)


def first_state(tx: optax.GradientTransformation, groups: int = 1) -> Any:
    return tx.init(grads_of(jnp.ones(groups)))


__all__ = ["RTOL", "assert_close", "clipjax", "first_state", "grads_of", "run", "runner"]
