"""Comparing two runs' trees (states, updates, parameters) leaf by leaf.

:func:`assert_trees_equal` for runs that must agree bit for bit (replicas, a
restored checkpoint); :func:`assert_trees_close` for the same computation in
another order (a data-parallel reduction, another process), with tolerances
relative to each leaf's largest magnitude. Plain ``rtol``/``atol`` comparisons
use ``chex.assert_trees_all_close``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

# Tolerances against a single-device run. The data-parallel gradient is the
# same sum in another order, so norms agree to about 1e-7 relative, and
# updates, parameters and first-order statistics to RTOL. Second moments and
# z-scores of nearly equal norms (a variance over the first few steps,
# z = (g - mean) / std) amplify that rounding by up to the norm/std ratio:
# those fields get SECOND_MOMENT_RTOL (measured: at most 2.2e-6).
RTOL = 1e-6
SECOND_MOMENT_RTOL = 1e-5
SECOND_MOMENTS = frozenset({"var", "m2", "std", "z", "spread"})


def _last_key(path: tuple[Any, ...]) -> str:
    key = path[-1] if path else None
    return str(getattr(key, "name", getattr(key, "key", key)))


def assert_trees_close(actual: Any, expected: Any, rtol: float = RTOL, what: str = "") -> None:
    """Same structure; bool/int leaves equal; float leaves within ``rtol`` of each other.

    Relative to the leaf's largest magnitude, so that an element that is the
    difference of two large numbers does not set the bar. Leaves named in
    ``SECOND_MOMENTS`` get ``max(rtol, SECOND_MOMENT_RTOL)``.
    """
    assert jax.tree.structure(actual) == jax.tree.structure(expected), what
    for (key_path, b), a in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual)
    ):
        path = jax.tree_util.keystr(key_path)
        tol = max(rtol, SECOND_MOMENT_RTOL) if _last_key(key_path) in SECOND_MOMENTS else rtol
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}{path}: {a.shape} vs {b.shape}"
        if not np.issubdtype(b.dtype, np.floating):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}{path}")
            continue
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=f"{what}{path}")
        finite = np.isfinite(b)
        if _last_key(key_path) == "m2":
            # A sum of squared differences of near-equal norms: an error of ε·|x|
            # in an observation moves m2 by about 2ε·|x|·sqrt(m2), far above
            # ε·m2 when the norms barely move; its square root (the spread of
            # the observations, what a rule reads) has the usual relative error.
            a, b = np.sqrt(np.maximum(a, 0)), np.sqrt(np.maximum(b, 0))
        bound = tol * max(float(np.max(np.abs(b[finite]), initial=0.0)), 1e-30)
        if _last_key(key_path) == "z":
            # A z-score near 0 has an absolute float32 error of about ulp(g)/std.
            bound = max(bound, 1e-5)
        error = float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))
        assert error <= bound, f"{what}{path}: max |difference| {error:.3g} > {bound:.3g}"


def assert_trees_equal(actual: Any, expected: Any, what: str = "") -> None:
    """Same structure, and leaves of the same shape and dtype with identical values."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), what
    for (key_path, b), a in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        where = f"{what}{jax.tree_util.keystr(key_path)}"
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        np.testing.assert_array_equal(a, b, err_msg=where)
