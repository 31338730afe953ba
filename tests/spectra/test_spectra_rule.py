"""spectra's rule against float64 NumPy: the exact SVD and the paper's own iteration.

The budgets: with ``alpha = 1 + s / c**2`` (``s`` the Gershgorin/Frobenius bound
on ``sigma_max**2``), ``A / alpha`` has eigenvalues in ``[1 / alpha, 1]``, and the
coupled iteration's product ``p = z y`` per eigenvalue grows by ``(3 - p)**2 / 4``
(9/4 while small) and then converges quadratically. For ``c >= sigma_max / 10``
``alpha`` is at most a few hundred, so 10 steps bring every eigenvalue to
convergence and what is left is float32 rounding of ``m``-term matmul sums
(measured at most 1.2e-6 relative, budget 1e-5); in bfloat16 (8 significant
bits, eps 7.8e-3) it measured at most 1.4e-2, budget 3e-2. Where ``c`` is far
below ``sigma_max`` and the matrix has near-zero singular values, 10 steps do
not converge (``1 / alpha`` below ``(4/9)**10``): the restatement of the
paper's iteration still agrees to float32 rounding there.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax

SHAPES = [(48, 48), (24, 96), (96, 24), (7, 130)]
RATIOS = [4.0, 1.0, 0.25, 0.1]  # c / sigma_max
FLOAT32_BUDGET = 1e-5
BFLOAT16_BUDGET = 3e-2


def exact(u: np.ndarray, c: float) -> np.ndarray:
    """The rule by SVD in float64: ``sigma / sqrt(1 + sigma**2 / c**2)`` times
    Muon's ``sqrt(max(1, fan_out / fan_in))`` of a ``[fan_in, fan_out]`` matrix."""
    left, sigma, right = np.linalg.svd(u.astype(np.float64), full_matrices=False)
    fan_in, fan_out = u.shape
    return (
        (left * (sigma / np.sqrt(1 + sigma**2 / c**2))) @ right * np.sqrt(max(1, fan_out / fan_in))
    )


def paper_iteration(u: np.ndarray, c: float, iterations: int = 10) -> np.ndarray:
    """``clip_sigvals`` and ``matrix_inv_sqrt_NS`` restated in float64, times the shape factor."""
    x = u.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    gram = x @ x.T
    s = min(np.abs(gram).sum(axis=1).max(), np.linalg.norm(gram))
    alpha = 1.0 + s / c**2
    eye = np.eye(gram.shape[0])
    a_hat = (eye + gram / c**2) / alpha
    y, z = a_hat, eye
    for _ in range(iterations):
        t = 0.5 * (3.0 * eye - z @ y)
        y, z = y @ t, t @ z
    out = (z / np.sqrt(alpha)) @ x
    out = out.T if tall else out
    fan_in, fan_out = u.shape
    return out * np.sqrt(max(1, fan_out / fan_in))


@functools.cache
def _compiled(dtype: Any, iterations: int | None) -> Any:
    def run(u: jax.Array, c: jax.Array) -> jax.Array:
        tx = clipjax.spectra(c, dtype=dtype, iterations=iterations)
        return tx.update({"w": u}, tx.init({"w": u}))[0]["w"]

    return jax.jit(run)


def clipped(
    u: np.ndarray, c: float, dtype: Any = None, iterations: int | None = None
) -> np.ndarray:
    """spectra's output, jitted once per shape (``c`` is an argument, as injected)."""
    out = _compiled(dtype, iterations)(jnp.asarray(u), jnp.float32(c))
    return np.asarray(out, np.float64)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_matrix(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_float32_iteration_equals_the_svd_rule(shape, ratio) -> None:
    u = random_matrix(shape)
    c = ratio * float(np.linalg.norm(u, 2))
    assert relative(clipped(u, c, dtype=jnp.float32), exact(u, c)) < FLOAT32_BUDGET


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", [1.0, 0.1])
def test_bfloat16_iteration_equals_the_svd_rule_within_bfloat16(shape, ratio) -> None:
    u = random_matrix(shape, seed=1)
    c = ratio * float(np.linalg.norm(u, 2))
    out = clipped(u, c)  # the default dtype: bfloat16
    assert relative(out, exact(u, c)) < BFLOAT16_BUDGET


@pytest.mark.parametrize("shape", SHAPES)
def test_another_c_fails_the_budget(shape) -> None:
    u = random_matrix(shape, seed=2)
    c = 0.25 * float(np.linalg.norm(u, 2))
    out = clipped(u, c, dtype=jnp.float32)
    assert relative(out, exact(u, 1.1 * c)) > 100 * FLOAT32_BUDGET
    assert relative(clipped(u, c), exact(u, 1.1 * c)) > BFLOAT16_BUDGET


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", [1.0, 0.1, 0.01])
def test_float32_iteration_equals_the_papers_iteration(shape, ratio) -> None:
    u = random_matrix(shape, seed=3)
    c = ratio * float(np.linalg.norm(u, 2))
    assert relative(clipped(u, c, dtype=jnp.float32), paper_iteration(u, c)) < FLOAT32_BUDGET


def test_where_ten_steps_do_not_converge_the_papers_iteration_still_agrees() -> None:
    # A square Gaussian matrix has singular values near 0; c = sigma_max / 100 puts
    # 1 / alpha near 1e-4, below (4/9)**10: the iteration, not the rounding, errs.
    u = random_matrix((48, 48), seed=4)
    c = 0.01 * float(np.linalg.norm(u, 2))
    out = clipped(u, c, dtype=jnp.float32)
    assert relative(out, exact(u, c)) > 1e-2
    assert relative(out, paper_iteration(u, c)) < FLOAT32_BUDGET
    # 30 steps converge; alpha near 1e4 amplifies the float32 rounding tenfold.
    more = clipped(u, c, dtype=jnp.float32, iterations=30)
    assert relative(more, exact(u, c)) < 10 * FLOAT32_BUDGET


def test_the_singular_values_are_soft_clipped_and_stay_below_c() -> None:
    u = random_matrix((32, 32), seed=5)
    c = 2.0
    sigma = np.linalg.svd(clipped(u, c, dtype=jnp.float32), compute_uv=False)
    want = np.linalg.svd(u.astype(np.float64), compute_uv=False)
    np.testing.assert_allclose(sigma, want / np.sqrt(1 + want**2 / c**2), rtol=1e-5)
    assert sigma.max() < c


def test_vectors_follow_the_papers_vector_rule_under_apply_to_all() -> None:
    tx = clipjax.spectra(1.0, apply_to="all")
    small, large = jnp.array([0.6, 0.0]), jnp.array([3.0, 4.0])  # norms 0.6 and 5
    tree = {"a": small, "b": large, "s": jnp.asarray(-2.0)}
    out, state = tx.update(tree, tx.init(tree))
    np.testing.assert_array_equal(out["a"], small)  # at or below c: unchanged
    np.testing.assert_allclose(out["b"], np.array([3.0, 4.0]) / np.sqrt(26.0), rtol=1e-6)
    np.testing.assert_allclose(out["s"], -2.0 / np.sqrt(5.0), rtol=1e-6)
    m = clipjax.metrics(state)
    assert float(m["spectra/global/sigma_bound"]) == pytest.approx(5.0)
    assert float(m["spectra/global/clipped_fraction"]) == pytest.approx(2 / 3)


def test_vectors_pass_unchanged_under_the_default_apply_to() -> None:
    tree = {"b": jnp.array([30.0, 40.0]), "w": jnp.asarray(random_matrix((4, 3)))}
    tx = clipjax.spectra(1.0)
    out, _ = tx.update(tree, tx.init(tree))
    assert out["b"] is tree["b"]


def test_shape_factor_is_muons_on_fan_out_over_fan_in() -> None:
    # A [fan_in, fan_out] kernel with fan_out = 4 fan_in: sqrt(4) = 2 on the clipped matrix.
    u = random_matrix((8, 32), seed=6)
    wide = clipped(u, 1e3, dtype=jnp.float32)  # c far above sigma: about u itself
    np.testing.assert_allclose(wide, 2.0 * exact(u, 1e3) / 2.0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(wide, 2.0 * u, rtol=1e-3, atol=1e-4)
    tall = clipped(u.T.copy(), 1e3, dtype=jnp.float32)  # fan_out < fan_in: factor 1
    np.testing.assert_allclose(tall, u.T, rtol=1e-3, atol=1e-4)
