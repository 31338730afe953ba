"""clip_activation_gradient against AXLearn's two backward rules, restated in float64 NumPy
from apple/axlearn's ``axlearn/common/gradient_monitor.py`` (AXLearn does not install
here): ``mode="zero"`` is ``top_k_clip_fn(k, method="topk")`` (the gradient, bit for bit,
and its top-k norms), ``k=0`` with AXLearn's percentiles is
``compute_grad_percentile_no_clip_fn()``; and where they differ, on non-finite norms, as
docs/defences.md says."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax
from tests.activation.reference import (
    DEFAULT_PERCENTILES,
    axlearn_percentiles,
    axlearn_top_k_clip,
    restated,
)

STATS_RTOL = 1e-5


def backward(g: Any, k: int, mode: str = "zero", percentiles: Any = None) -> tuple[Any, dict]:
    """``(the gradient passed on, {field: value})`` for the output gradient ``g``."""
    g = jnp.asarray(g)
    stats = clipjax.activation_stats_init(k=k, percentiles=percentiles)
    clip = lambda y, s: clipjax.clip_activation_gradient(y, s, k=k, mode=mode,
                                                         percentiles=percentiles)  # fmt: skip
    _, pull = jax.vjp(clip, jnp.zeros_like(g), stats)
    out, stats_grad = jax.jit(pull)(g)
    return np.asarray(out), clipjax.activation_metrics(stats_grad, name="y")


def gradient(shape: tuple[int, ...], seed: int, ties: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = rng.normal(size=shape) * np.exp(rng.normal(size=(*shape[:-1], 1)))
    if ties:  # three tokens share the largest norm, two others the fifth largest
        flat = g.reshape(-1, shape[-1])
        order = np.argsort(-np.linalg.norm(flat, axis=-1))
        flat[order[1]] = flat[order[2]] = flat[order[0]]
        flat[order[5]] = flat[order[4]]
    return g.astype(np.float32)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("k", [1, 2, 4, 5, 16])
def test_zero_mode_is_axlearn_top_k_clip_fn_topk(k: int, ties: bool) -> None:
    g = gradient((4, 32, 16), seed=k, ties=ties)
    out, m = backward(g, k)
    want, topk = axlearn_top_k_clip(g, k)
    np.testing.assert_array_equal(out, want.astype(np.float32))  # a zero or the same value
    got_topk = [m["activation_grad/y/top_norm"]]
    got_topk += [m[f"activation_grad/y/top_norm_{i}"] for i in range(2, k + 1)]
    np.testing.assert_allclose(got_topk, topk, rtol=STATS_RTOL)
    # AXLearn's clip_threshold (top_norms[-1]) and how many tokens it zeroed.
    np.testing.assert_allclose(m["activation_grad/y/threshold"], topk[-1], rtol=STATS_RTOL)
    zeroed = int(np.sum(np.all(want == 0, axis=-1)))
    assert int(m["activation_grad/y/clipped_tokens"]) == zeroed
    if ties and k in (1, 2, 5):
        assert zeroed > k  # a tie at the k-th largest norm zeroes every tied token


@pytest.mark.parametrize("shape", [(4, 32, 16), (8, 1024, 4), (7, 13)])
def test_monitor_is_axlearn_compute_grad_percentile_no_clip_fn(shape: tuple[int, ...]) -> None:
    g = gradient(shape, seed=len(shape))
    out, m = backward(g, 0, percentiles=DEFAULT_PERCENTILES)
    same, percentiles = axlearn_percentiles(g)
    np.testing.assert_array_equal(out, same.astype(np.float32))  # untouched
    got = [m[f"activation_grad/y/p{p}"] for p in ("50", "99.9", "99.99", "99.999")]
    np.testing.assert_allclose(got, percentiles, rtol=STATS_RTOL)
    assert "activation_grad/y/threshold" not in m and "activation_grad/y/clipped_tokens" not in m


def test_percentiles_are_exact_where_float32_positions_would_not_be() -> None:
    """Among 2**18 tokens a float32 position ``q/100 * (n - 1)`` is off by a few thousandths
    of a rank; clipjax takes it in float64, so a percentile that falls between two norms a
    long way apart is NumPy's (the float32 position misses it by a hundred tolerances)."""
    n, qs = 2**18, (99.999, 33.3)
    ranks = np.arange(n, dtype=np.float64)
    lows = [int(np.floor(q / 100 * (n - 1))) for q in qs]
    norms = ranks + 1e6 * (ranks > lows[1]) + 1e9 * (ranks > lows[0])  # a jump at each
    g = np.zeros((n, 2), np.float32)
    g[:, 1] = np.random.default_rng(5).permutation(norms.astype(np.float32))
    _, m = backward(g, 0, percentiles=qs)
    got = [m["activation_grad/y/p99.999"], m["activation_grad/y/p33.3"]]
    _, want = axlearn_percentiles(g, qs)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    ordered = np.sort(g[:, 1]).astype(np.float64)
    for q, value in zip(qs, want):
        position = float(np.float32(q / 100) * np.float32(n - 1))  # float32 arithmetic
        low = int(np.floor(position))
        naive = ordered[low] + (ordered[low + 1] - ordered[low]) * (position - low)
        assert abs(naive - value) > 100 * 1e-6 * value, (q, naive, value)


def test_where_axlearn_differs_non_finite_norms() -> None:
    """A NaN token: AXLearn's top_k ranks it first, so with k=1 its threshold is NaN and
    every token is zeroed, and its percentiles are NaN. clipjax zeroes the NaN token, then
    the k largest finite ones, and reports the finite tokens' statistics."""
    g = gradient((2, 16, 8), seed=9)
    g[0, 3, 2] = np.nan
    axlearn, topk = axlearn_top_k_clip(g, 1)
    assert np.isnan(topk[0]) and not np.any(axlearn)  # everything zeroed
    assert np.isnan(axlearn_percentiles(g)[1]).all()
    out, m = backward(g, 1, percentiles=DEFAULT_PERCENTILES)
    want, stats = restated(g, 1, "zero", DEFAULT_PERCENTILES)
    np.testing.assert_array_equal(out, want.astype(np.float32))
    assert int(np.sum(np.all(out == 0, axis=-1))) == 2  # the NaN token and the largest
    assert int(m["activation_grad/y/nonfinite_tokens"]) == 1
    for name, value in stats.items():
        np.testing.assert_allclose(m[f"activation_grad/y/{name}"], value, rtol=STATS_RTOL)
