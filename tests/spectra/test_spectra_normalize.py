"""spectra's ``post_process="normalize"`` against float64 NumPy: the paper's
``normalize_sigvals`` (mlolab/llm-spectral-clipping, ``src/optim/post_process.py``)
restated, and the same rule by an exact SVD.

The rule: the wide side ``X`` divided by ``||X||_F + 1e-7``, then ``iterations`` steps
of ``X <- a X + (b A + c A A) X``, ``A = X X^T``, ``(a, b, c) = (3.4445, -4.7750,
2.0315)``, then Muon's shape factor. By SVD, each singular value ``s`` of the scaled
matrix goes through ``p(s) = a s + b s**3 + c s**5`` ``iterations`` times, the singular
vectors kept. ``p`` does not converge to 1 but oscillates in about [0.68, 1.13], so
rounding is not damped: in float32 the iteration measured at most 3e-6 relative to
the float64 rule (budget 1e-5); in bfloat16 (the default, as the paper's) about 0.11
(budget 0.2), its singular values still in about [0.6, 1.2].
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.spectra.test_spectra_rule import FLOAT32_BUDGET, random_matrix, relative

SHAPES = [(48, 48), (24, 96), (96, 24), (7, 130)]
A, B, C = 3.4445, -4.7750, 2.0315
BFLOAT16_BUDGET = 0.2


def shape_factor(shape: tuple[int, int]) -> float:
    fan_in, fan_out = shape
    return float(np.sqrt(max(1, fan_out / fan_in)))


def paper_normalize(u: np.ndarray, iterations: int = 10) -> np.ndarray:
    """``normalize_sigvals`` restated in float64, times the shape factor."""
    x = u.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(iterations):
        a = x @ x.T
        x = A * x + (B * a + C * a @ a) @ x
    return (x.T if tall else x) * shape_factor(u.shape)


def exact(u: np.ndarray, iterations: int = 10) -> np.ndarray:
    """The rule by SVD in float64: the quintic applied to each scaled singular value."""
    left, sigma, right = np.linalg.svd(u.astype(np.float64), full_matrices=False)
    s = sigma / (np.linalg.norm(u.astype(np.float64)) + 1e-7)
    for _ in range(iterations):
        s = A * s + B * s**3 + C * s**5
    return (left * s) @ right * shape_factor(u.shape)


@functools.cache
def _compiled(dtype: Any, iterations: int | None) -> Any:
    def run(u: jax.Array) -> jax.Array:
        tx = clipjax.spectra(None, post_process="normalize", dtype=dtype, iterations=iterations)
        return tx.update({"w": u}, tx.init({"w": u}))[0]["w"]

    return jax.jit(run)


def normalized(u: np.ndarray, dtype: Any = None, iterations: int | None = None) -> np.ndarray:
    return np.asarray(_compiled(dtype, iterations)(jnp.asarray(u)), np.float64)


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_normalize_equals_the_papers_iteration_and_the_svd_rule(shape) -> None:
    u = random_matrix(shape, seed=11)
    out = normalized(u, dtype=jnp.float32)
    assert relative(paper_normalize(u), exact(u)) < 1e-12  # the two restatements agree
    assert relative(out, paper_normalize(u)) < FLOAT32_BUDGET
    assert relative(out, exact(u)) < FLOAT32_BUDGET


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_normalize_equals_the_rule_within_bfloat16(shape) -> None:
    u = random_matrix(shape, seed=12)
    out = normalized(u)  # the default dtype: bfloat16, as the paper's
    assert relative(out, exact(u)) < BFLOAT16_BUDGET
    sigma = np.linalg.svd(out / shape_factor(shape), compute_uv=False)
    assert sigma.min() > 0.6 and sigma.max() < 1.2


@pytest.mark.parametrize("shape", SHAPES)
def test_another_step_count_or_no_shape_factor_fails_the_budget(shape) -> None:
    # Negative controls: Muon's own 5 steps, or the rule without Muon's shape factor
    # (on the wide [fan_in < fan_out] matrices), are far outside the budget.
    u = random_matrix(shape, seed=13)
    out = normalized(u, dtype=jnp.float32)
    assert relative(out, exact(u, iterations=5)) > 1000 * FLOAT32_BUDGET
    assert relative(normalized(u, dtype=jnp.float32, iterations=5), exact(u, 5)) < FLOAT32_BUDGET
    if shape_factor(shape) > 1:
        assert relative(out, exact(u) / shape_factor(shape)) > 0.1


def test_singular_values_are_set_to_about_one_whatever_their_size() -> None:
    # Singular values 1e-3 to 1e3 (Frobenius norm about 1e3): all come out in
    # [0.68, 1.14] after 10 steps, the singular vectors kept.
    rng = np.random.default_rng(14)
    left, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    right, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    sigma = np.logspace(-3, 3, 16)[::-1]
    u = ((left * sigma) @ right.T).astype(np.float32)
    out = normalized(u, dtype=jnp.float32, iterations=30)
    got = np.diag(left.T @ out @ right)
    assert got.min() > 0.68 and got.max() < 1.14
    off = left.T @ out @ right - np.diag(got)
    assert np.abs(off).max() < 1e-3


def test_normalize_vectors_under_apply_to_all_and_metrics() -> None:
    tx = clipjax.spectra(None, post_process="normalize", apply_to="all", dtype=jnp.float32)
    u = random_matrix((6, 10), seed=15)
    tree = {"b": jnp.array([3.0, 4.0]), "s": jnp.asarray(-2.0), "w": jnp.asarray(u)}
    out, state = jax.jit(tx.update)(tree, tx.init(tree))
    np.testing.assert_allclose(out["b"], np.array([3.0, 4.0]) / (5.0 + 1e-7), rtol=1e-6)
    np.testing.assert_allclose(out["s"], -1.0, rtol=1e-6)
    assert relative(np.asarray(out["w"], np.float64), exact(u)) < FLOAT32_BUDGET
    m = clipjax.metrics(state)
    assert float(m["spectra/global/threshold"]) == 1.0
    gram = u.astype(np.float64) @ u.T.astype(np.float64)
    bound = np.sqrt(min(np.abs(gram).sum(axis=1).max(), np.linalg.norm(gram)))
    assert float(m["spectra/global/sigma_bound"]) == pytest.approx(max(5.0, bound), rel=1e-5)
    assert float(m["spectra/global/clipped_fraction"]) == pytest.approx(1.0)  # bounds above 1


def test_a_zero_matrix_stays_zero_and_the_state_stays_finite() -> None:
    tx = clipjax.spectra(None, post_process="normalize")
    tree = {"w": jnp.zeros((4, 6))}
    out, state = jax.jit(tx.update)(tree, tx.init(tree))
    np.testing.assert_array_equal(out["w"], np.zeros((4, 6)))
    assert not bool(clipjax.metrics(state)["spectra/global/clipped"])
    chex.assert_tree_all_finite(state.metrics)


def test_c_is_not_read_under_normalize() -> None:
    tree = {"w": jnp.asarray(random_matrix((5, 7), seed=16))}
    a = clipjax.spectra(None, post_process="normalize")
    b = clipjax.spectra(0.01, post_process="normalize")
    got = jax.jit(a.update)(tree, a.init(tree))[0]
    chex.assert_trees_all_equal(got, jax.jit(b.update)(tree, b.init(tree))[0])


def test_normalize_under_jit_scan_and_inject_hyperparams() -> None:
    tree = {"w": jnp.asarray(random_matrix((6, 10), seed=17)), "b": jnp.ones(10)}
    plain = clipjax.spectra(1.0, post_process="normalize", apply_to="all", dtype=jnp.float32)
    injected = optax.inject_hyperparams(clipjax.spectra, static_args=("dtype",))(
        c=1.0, post_process="normalize", apply_to="all", dtype=jnp.float32
    )
    grads = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), tree)

    def scan(tx):
        def body(state, g):
            out, state = tx.update(g, state)
            return state, out

        return jax.lax.scan(body, tx.init(tree), grads)[1]

    step = jax.jit(plain.update)
    want = [step(jax.tree.map(lambda x, i=i: x[i], grads), plain.init(tree))[0] for i in range(3)]
    want = jax.tree.map(lambda *x: jnp.stack(x), *want)
    chex.assert_trees_all_close(jax.jit(lambda: scan(plain))(), want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(jax.jit(lambda: scan(injected))(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(c=1.0, post_process="orthogonalize"), "post_process must be one of"),
        (dict(c=None), "c must be a number > 0"),
        (dict(c=-1.0, post_process="normalize"), "c must be > 0"),
        (
            dict(c=None, post_process="normalize", warmup_steps=3, learning_rate=lambda n: 1.0),
            "post_process='normalize' has no c to schedule",
        ),
        (
            dict(c=None, post_process="normalize", decay="linear", total_steps=10),
            "post_process='normalize' has no c to schedule",
        ),
    ],
)
def test_bad_normalize_arguments_are_refused_naming_them(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        clipjax.spectra(**kwargs)
