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


def run_trees(txs: Sequence[Any], norms: Any, trees: Sequence[Callable]) -> list:
    """Every ``txs[i]`` (any optax transform) on ``trees[i](row)`` of one ``[steps, k]``
    sequence of norms, in one jitted scan; per transform ``(metrics, outputs, inputs,
    same)``: ``clipjax.metrics`` per step, the per-leaf norms of the output and the input,
    and per leaf "output identical to input" (numpy ``[steps]`` arrays)."""
    seq = jnp.asarray(np.asarray(norms, np.float64), jnp.float32)
    params = [t(jnp.ones(seq.shape[1], jnp.float32)) for t in trees]
    state0 = tuple(tx.init(p) for tx, p in zip(txs, params))

    def step(states: Any, row: jax.Array) -> Any:
        new, rec = [], []
        for tx, st, tree, p in zip(txs, states, trees, params):
            grads = tree(row)
            out, st = tx.update(grads, st, p)
            same = jax.tree.map(lambda a, b: jnp.array_equal(a, b, equal_nan=True), out, grads)
            new.append(st)
            rec.append((clipjax.metrics(st), group_norms(out), group_norms(grads), same))
        return tuple(new), rec

    return jax.tree.map(np.asarray, jax.jit(lambda q: jax.lax.scan(step, state0, q)[1])(seq))


def run_tree(tx: Any, norms: Any, make_tree: Callable = flat_tree) -> tuple:
    """:func:`run_trees` of one transform: ``(metrics, (outputs, inputs), same)``."""
    metrics, outs, ins, same = run_trees([tx], norms, [make_tree])[0]
    return metrics, (outs, ins), same


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
