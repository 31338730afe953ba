"""Running clipjax on trees of given group norms, reading ``clipjax.metrics()``, and
comparing what it reports with a restatement."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import clipjax
from tests.restate._common import RTOL, Z_ATOL

UNIT = np.array([0.5, -0.5, 0.5, -0.5])


def flat_tree(row: jax.Array) -> dict[str, jax.Array]:
    """One leaf per column: ``{"g0": row[0] * u, ...}`` (per_param groups g0, g1, ...)."""
    unit = jnp.asarray(UNIT, jnp.float32)
    return {f"g{i}": row[i] * unit for i in range(row.shape[0])}


def layer_tree(row: jax.Array) -> dict[str, Any]:
    """Layers ``l0, l1, ...`` with a kernel and a bias whose joint norm is ``row[i]``.

    kernel = 0.6 row[i] u, bias = 0.8 row[i] u[:2]*sqrt(2) (norms 0.6 and 0.8 of it).
    """
    unit = jnp.asarray(UNIT, jnp.float32)
    bias_unit = jnp.asarray([math.sqrt(0.5), -math.sqrt(0.5)], jnp.float32)
    return {
        f"l{i}": {"kernel": 0.6 * row[i] * unit, "bias": 0.8 * row[i] * bias_unit}
        for i in range(row.shape[0])
    }


def group_norms(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.linalg.norm(a.astype(jnp.float32)), tree)


def run_tree(
    tx: Any, norms: np.ndarray, make_tree: Callable[[jax.Array], Any] = flat_tree
) -> tuple[dict[str, np.ndarray], Any, Any]:
    """Runs ``tx`` (any optax transform) over ``[steps, k]`` norms in one jitted scan.

    Returns ``(metrics, outputs, inputs)``: ``clipjax.metrics`` per step (arrays
    ``[steps]``) and the per-leaf norms of the transform's output and input
    (trees of ``[steps]`` arrays), plus per-leaf "output identical to input".
    """
    seq = jnp.asarray(np.asarray(norms, np.float64), jnp.float32)
    params = make_tree(jnp.ones(seq.shape[1], jnp.float32))
    state0 = tx.init(params)

    def step(state: Any, row: jax.Array) -> Any:
        grads = make_tree(row)
        out, state = tx.update(grads, state, params)
        same = jax.tree.map(lambda a, b: jnp.array_equal(a, b, equal_nan=True), out, grads)
        return state, (clipjax.metrics(state), group_norms(out), group_norms(grads), same)

    metrics, outs, ins, same = jax.jit(lambda s: jax.lax.scan(step, state0, s)[1])(seq)
    m = {k: np.asarray(v) for k, v in metrics.items()}
    return m, (jax.tree.map(np.asarray, outs), jax.tree.map(np.asarray, ins)), same


def check_run(
    tx: Any, norms: Any, want: dict[str, np.ndarray], prefix: str, make_tree: Callable = flat_tree
) -> dict[str, np.ndarray]:
    """:func:`run_tree` on ``norms`` (``[steps]`` or ``[steps, k]``) against the restatement
    ``want``: :func:`compare`, the scale applied to every leaf on the finite steps, and the
    non-finite steps passed unchanged. Returns the metrics."""
    norms = np.asarray(norms, np.float64)
    got, (outs, ins), same = run_tree(tx, norms.reshape(len(norms), -1), make_tree)
    compare(got, want, prefix)
    finite = np.isfinite(want["grad_norm"])
    for o, i, sm in zip(jax.tree.leaves(outs), jax.tree.leaves(ins), jax.tree.leaves(same)):
        np.testing.assert_allclose(o[finite] / i[finite], want["scale"][finite], rtol=RTOL)
        assert np.all(np.asarray(sm)[~finite]), "a non-finite step must pass unchanged"
    return got


def compare(
    got: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
    prefix: str,
    fields: Sequence[str] | None = None,
    rtol: float = RTOL,
    atol: float = 1e-6,
    atol_for: dict[str, float] | None = None,
) -> None:
    """``got[prefix + field]`` vs ``want[field]`` for every field the restatement defines.

    Positions where the restatement has NaN (undefined by the rule) are not
    compared; elsewhere the finite/infinite pattern must match and finite values
    agree to ``rtol`` (``atol`` only for values near 0, e.g. a std of ~0).
    Integer/boolean fields must match exactly. ``atol_for`` overrides ``atol``
    per field; by default ``z`` gets ``Z_ATOL``.
    """
    atol_for = {"z": Z_ATOL, **(atol_for or {})}
    fields = list(want) if fields is None else list(fields)
    for f in fields:
        key = prefix + f
        assert key in got, f"{key} missing from metrics: {sorted(got)[:20]}..."
        g = np.asarray(got[key], np.float64)
        w = np.asarray(want[f], np.float64)
        assert g.shape == w.shape, (key, g.shape, w.shape)
        defined = ~np.isnan(w)
        if f in ("count", "step", "clipped_count", "nonfinite_count", "clipped", "capped"):
            bad = np.nonzero(g[defined] != w[defined])[0]
            assert bad.size == 0, (
                f"{key}: first mismatch at {np.nonzero(defined)[0][bad[:5]]}: "
                f"got {g[defined][bad[:5]]}, want {w[defined][bad[:5]]}"
            )
            continue
        gd, wd = g[defined], w[defined]
        np.testing.assert_array_equal(np.isfinite(gd), np.isfinite(wd), err_msg=key)
        fin = np.isfinite(wd)
        np.testing.assert_array_equal(gd[~fin], wd[~fin], err_msg=key)
        tol = atol_for.get(f, atol)
        np.testing.assert_allclose(gd[fin], wd[fin], rtol=rtol, atol=tol, err_msg=key)
