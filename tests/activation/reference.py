"""Float64 NumPy restatements: AXLearn's two backward rules, from the published code, and
clipjax's rule as ``clip_activation_gradient``'s docstring states it.

AXLearn: apple/axlearn, ``axlearn/common/gradient_monitor.py`` (the stored copy read for
this port is commit 30cac9a7163f4e3b56a9e583aa4f92282b706d71):

* ``top_k_clip_fn(k, method="topk")`` -> ``_top_k_clipping``: ``per_token_norm =
  jnp.linalg.norm(g.astype(jnp.float32), axis=-1)``, ``topk, ids =
  jax.lax.top_k(flat_norm, k)``, ``threshold = topk[-1]``, ``is_valid = per_token_norm <
  threshold``, ``clipped = jnp.where(jnp.expand_dims(is_valid, -1), g, 0)``; returns
  ``(clipped, topk)``, after ``assert 1 <= k < len(flat_norm)``.
* ``compute_grad_percentile_no_clip_fn(stats_arr)``: ``(g, jnp.percentile(per_token_norm,
  jnp.array(stats_arr)))``, over every token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DEFAULT_PERCENTILES = (50, 99.9, 99.99, 99.999)  # AXLearn's DEFAULT_PERCENTILES


def token_norms(g: Any) -> np.ndarray:
    """``[...]``: each token's L2 norm over the last axis, in float64."""
    return np.linalg.norm(np.asarray(g, np.float64), axis=-1)


def axlearn_top_k_clip(g: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """AXLearn's ``top_k_clip_fn(k, method="topk")``: ``(clipped g, top-k norms)``."""
    g = np.asarray(g, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        norms = token_norms(g)
    flat = norms.ravel()
    assert 1 <= k < len(flat), "k must be >= 1 and < token count."
    # jax.lax.top_k: descending, a NaN above everything (as XLA orders it).
    nan = np.isnan(flat)
    topk = np.concatenate([flat[nan], np.sort(flat[~nan])[::-1]])[:k]
    threshold = topk[-1]
    with np.errstate(invalid="ignore"):
        is_valid = norms < threshold
    return np.where(is_valid[..., None], g, 0.0), topk


def axlearn_percentiles(
    g: Any, stats_arr: tuple[float, ...] = DEFAULT_PERCENTILES
) -> tuple[np.ndarray, np.ndarray]:
    """AXLearn's ``compute_grad_percentile_no_clip_fn(stats_arr)``: ``(g, percentiles)``."""
    g = np.asarray(g, np.float64)
    return g, np.percentile(token_norms(g), stats_arr)


def restated(
    g: Any, k: int, mode: str = "zero", percentiles: tuple[float, ...] = ()
) -> tuple[np.ndarray, dict[str, float]]:
    """clipjax's rule: ``(the gradient passed on, {field: value})``.

    Non-finite tokens (a NaN or Inf in the gradient, or a float32 sum of squares that
    overflows) are zeroed when ``k >= 1`` and counted; every statistic is over the finite
    tokens; a norm that does not exist reads 0. ``mode="zero"``: tokens at or above the
    k-th largest finite norm are zeroed; ``mode="clip"``: tokens above the (k+1)-th are
    scaled to it.
    """
    g = np.asarray(g, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        norms = token_norms(g)
        # clipjax sums the squares in float32: a sum past float32's largest is infinite.
        finite = np.isfinite(norms) & (norms**2 <= np.finfo(np.float32).max)
    values = np.sort(norms[finite])[::-1]
    nth = lambda i: float(values[i - 1]) if i <= len(values) else 0.0  # the i-th largest
    stats: dict[str, float] = {"top_norm": nth(1)}
    stats.update({f"top_norm_{i}": nth(i) for i in range(2, k + 1)})
    out = g
    if k >= 1:
        if mode == "zero":
            threshold = nth(k)
            clipped = finite & (norms >= threshold)
            out = np.where((finite & ~clipped)[..., None], g, 0.0)
        else:
            threshold = nth(k + 1)
            clipped = finite & (norms > threshold)
            scale = np.where(clipped, threshold / np.where(clipped, norms, 1.0), 1.0)
            out = np.where(finite[..., None], g * scale[..., None], 0.0)
        stats["threshold"] = threshold
        stats["clipped_tokens"] = float((clipped & (norms > 0)).sum())
    stats["nonfinite_tokens"] = float((~finite).sum())
    for p in percentiles:
        label = np.format_float_positional(float(p), trim="-")
        stats[f"p{label}"] = float(np.percentile(norms[finite], p)) if finite.any() else 0.0
    return out, stats
