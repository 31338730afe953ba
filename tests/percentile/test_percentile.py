"""Percentiles of |x|: the sort against numpy, the radix select against its bound."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clipjax import _percentile
from clipjax._percentile import (
    AUTO_EXACT_MAX_SIZE,
    approx_percentile,
    approx_relative_error,
    exact_percentile,
)

PERCENTILES = (0.1, 1.0, 25.0, 50.0, 90.0, 99.0, 99.9, 100.0)
GENERATORS = {
    "normal": lambda rng, n: rng.standard_normal(n),
    "cauchy": lambda rng, n: rng.standard_cauchy(n),  # heavy tails
    "lognormal": lambda rng, n: rng.lognormal(0.0, 8.0, n) * rng.choice([-1, 1], n),  # ~30 decades
    "ties": lambda rng, n: rng.integers(-3, 4, n).astype(np.float64) * 0.5,
    "zeros": lambda rng, n: np.zeros(n),
    "outlier": lambda rng, n: np.where(np.arange(n) == n // 3, -1e30, rng.standard_normal(n)),
    "one_value": lambda rng, n: np.full(n, -0.3),
}
KINDS = tuple(GENERATORS)


def data(kind: str, n: int, seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    return GENERATORS[kind](np.random.default_rng(seed), n).astype(dtype)


FEW = (1.0, 50.0, 99.5)


@functools.cache
def all_percentiles(fn: Any, percentiles: tuple[float, ...] = PERCENTILES, **kwargs: Any) -> Any:
    """One jitted call (compiled once per shape) for each of ``percentiles``, static."""
    return jax.jit(lambda x: jnp.stack([fn(x, p, **kwargs) for p in percentiles]))


@functools.cache
def one_percentile(fn: Any) -> Any:
    """``fn(x, p)`` jitted with ``p`` static (as a Python number it is in the clippers)."""
    return jax.jit(fn, static_argnums=1)


def within_bound(approx: np.ndarray, exact: np.ndarray, eps: float, dtype: Any) -> np.ndarray:
    """The documented bound: ``|approx - exact| <= eps·exact + tiny + 4 ulp(exact)``."""
    tiny = float(np.finfo(dtype).tiny)
    ulp = np.spacing(np.abs(exact).astype(dtype)).astype(np.float64)
    return np.abs(approx - exact) <= eps * exact + tiny + 4 * ulp


EXACT = all_percentiles(exact_percentile)
APPROX = all_percentiles(approx_percentile)
# Traced percentiles, one compilation per size for any number of them; both
# methods then share the same (float32) rank, so the bound applies as is.
MANY = jnp.asarray([0.1, 0.5, 1, 5, 25, 33.3, 50, 66.7, 90, 95, 99, 99.5, 99.9, 100], jnp.float32)
EXACT_TRACED = jax.jit(jax.vmap(exact_percentile, in_axes=(None, 0)))
APPROX_TRACED = jax.jit(jax.vmap(approx_percentile, in_axes=(None, 0)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 4097])
def test_exact_matches_numpy(kind: str, n: int) -> None:
    x = data(kind, n, seed=n)
    expected = np.percentile(np.abs(x.astype(np.float64)), PERCENTILES)
    got = np.asarray(EXACT(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(got, expected, rtol=2e-7, atol=0)


@pytest.mark.parametrize("n", [1, 3, 1000, 100_000])
def test_approx_within_documented_bound(n: int) -> None:
    for kind in KINDS:
        x = jnp.asarray(data(kind, n, seed=n + 1))
        exact = np.asarray(EXACT_TRACED(x, MANY), np.float64)
        approx = np.asarray(APPROX_TRACED(x, MANY), np.float64)
        ok = within_bound(approx, exact, approx_relative_error(), np.float32)
        assert ok.all(), (kind, list(zip(np.asarray(MANY), exact, approx)))


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
def test_approx_with_static_percentiles(kind: str) -> None:
    x = jnp.asarray(data(kind, 5000, seed=8))
    exact = np.asarray(EXACT(x), np.float64)
    approx = np.asarray(APPROX(x), np.float64)
    assert within_bound(approx, exact, approx_relative_error(), np.float32).all()


def test_approx_within_bound_on_a_million_elements() -> None:
    x = jnp.asarray(data("cauchy", 1_000_000, seed=3))
    exact = np.asarray(EXACT_TRACED(x, MANY), np.float64)
    approx = np.asarray(APPROX_TRACED(x, MANY), np.float64)
    eps = approx_relative_error()
    assert eps == 2.0**-17
    assert within_bound(approx, exact, eps, np.float32).all()
    # The bound is not vacuous: generic data shows errors of its order.
    assert np.max(np.abs(approx - exact) / exact) > eps / 100


@pytest.mark.parametrize("bins,passes", [(2**16, 2), (2**11, 3)])
def test_radix_select_resolving_every_bit_is_exact(bins: int, passes: int) -> None:
    assert approx_relative_error(bins, passes) == 0.0
    full = all_percentiles(approx_percentile, FEW, bins=bins, passes=passes)
    exact = all_percentiles(exact_percentile, FEW)
    for kind in ("normal", "lognormal", "ties"):
        x = jnp.asarray(data(kind, 5000, seed=5))
        np.testing.assert_array_equal(np.asarray(full(x)), np.asarray(exact(x)))


def test_coarser_settings_have_looser_documented_bounds() -> None:
    x = jnp.asarray(data("lognormal", 5000, seed=9))
    exact = np.asarray(EXACT_TRACED(x, MANY), np.float64)
    for bins, passes in [(2**11, 1), (2**13, 2)]:
        eps = approx_relative_error(bins, passes)
        fn = functools.partial(approx_percentile, bins=bins, passes=passes)
        approx = np.asarray(jax.jit(jax.vmap(fn, (None, 0)))(x, MANY), np.float64)
        assert within_bound(approx, exact, eps, np.float32).all()
        assert np.max(np.abs(approx - exact) / exact) > eps / 100
    assert approx_relative_error(2**11, 1) == 2.0**-4


def test_union_of_arrays_equals_their_concatenation() -> None:
    parts = [data("normal", n, seed=n) for n in (70_000, 10, 300, 1)]
    parts = [p.reshape(-1, 2) if p.size % 2 == 0 else p for p in parts]
    joined = jnp.asarray(np.concatenate([p.reshape(-1) for p in parts]))
    arrays = [jnp.asarray(p) for p in parts]
    for fn in (exact_percentile, approx_percentile):
        few = all_percentiles(fn, FEW)
        np.testing.assert_array_equal(np.asarray(few(arrays)), np.asarray(few(joined)))


def test_auto_switches_at_the_documented_size() -> None:
    assert isinstance(AUTO_EXACT_MAX_SIZE, int) and AUTO_EXACT_MAX_SIZE == 2**12
    for n, expected in [(AUTO_EXACT_MAX_SIZE, "exact"), (AUTO_EXACT_MAX_SIZE + 1, "approx")]:
        x = jnp.asarray(data("normal", n, seed=11))
        select = jax.jit(lambda x, method: _percentile.select(x, 37.0, method)[0], static_argnums=1)
        auto, exact, approx = (select(x, method) for method in ("auto", "exact", "approx"))
        assert float(exact) != float(approx)  # otherwise the test proves nothing
        assert float(auto) == float({"exact": exact, "approx": approx}[expected])


def test_traced_percentile_matches_static_up_to_float32_rank() -> None:
    x = jnp.asarray(data("normal", 30_000, seed=2))
    where = [PERCENTILES.index(p) for p in (0.1, 50.0, 90.0, 100.0)]
    for static_fn, traced_fn in ((EXACT, EXACT_TRACED), (APPROX, APPROX_TRACED)):
        static = np.asarray(static_fn(x))[where]
        traced = np.asarray(traced_fn(x, jnp.asarray(np.float32(PERCENTILES)[where])))
        # The rank is float32 then: off by at most ~n·2^-23 positions.
        np.testing.assert_allclose(traced, static, rtol=1e-4)


def test_low_precision_input_is_computed_in_float32() -> None:
    x = data("normal", 3000, seed=4)
    for dtype in (jnp.bfloat16, jnp.float16):
        low = jnp.asarray(x, dtype)
        expected = np.percentile(np.abs(np.asarray(low, np.float64)), 90.0)
        got = one_percentile(exact_percentile)(low, 90.0)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(float(got), expected, rtol=1e-6)
        approx = float(one_percentile(approx_percentile)(low, 90.0))
        assert within_bound(np.float64(approx), expected, approx_relative_error(), np.float32)


def test_float64(x64: None) -> None:
    x = data("lognormal", 20_000, seed=6, dtype=np.float64)
    expected = np.percentile(np.abs(x), PERCENTILES)
    got = np.asarray(EXACT(jnp.asarray(x)))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-15)
    eps = approx_relative_error(dtype=jnp.float64)
    assert eps == 2.0**-26  # three passes of 12 bits
    approx = np.asarray(all_percentiles(approx_percentile, FEW)(jnp.asarray(x)))
    expected = np.percentile(np.abs(x), FEW)
    assert within_bound(approx, expected, eps, np.float64).all()


def test_nonfinite_input_gives_nan_and_empty_input_zero() -> None:
    for bad in (np.nan, np.inf, -np.inf):
        x = data("normal", 4097, seed=1)
        x[17] = bad
        assert np.isnan(np.asarray(EXACT(jnp.asarray(x)))).all()
        assert np.isnan(np.asarray(APPROX(jnp.asarray(x)))).all()
    assert float(exact_percentile(jnp.zeros((0,)), 50.0)) == 0.0
    assert float(approx_percentile([], 50.0)) == 0.0


@pytest.mark.parametrize(
    "arg, value", [*[("bins", b) for b in (1000, 2**10, 2**21, True, 4096.0)], ("passes", 0)]
)
def test_invalid_bins_and_passes(arg: str, value: Any) -> None:
    with pytest.raises(ValueError, match=arg):
        approx_percentile(jnp.ones(3), 50.0, **{arg: value})
