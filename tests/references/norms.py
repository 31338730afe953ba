"""Norm sequences the differential tests feed clipjax and the references alike.

All return float64 numpy arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tests.references._common import _NAN

SPIKE_FACTORS: tuple[float, ...] = (10.0, 100.0, 1000.0, 30.0)


def spikes(
    n: int = 400,
    seed: int = 0,
    *,
    noise: float = 0.1,
    factors: Sequence[float] = SPIKE_FACTORS,
    at: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A stationary stream around 1 with a few large spikes.

    ``base[t] = exp(noise * N(0, 1))`` (``numpy.random.default_rng(seed)``),
    median 1, then ``norms[at[i]] = base[at[i]] * factors[i]``.

    Args:
      n: number of steps.
      seed: RNG seed (deterministic).
      noise: log-normal noise level.
      factors: spike multipliers (default ×10, ×100, ×1000, ×30).
      at: spike steps; default ``round(linspace(0.3, 0.8, len(factors)) * n)``
        (n=400: 120, 187, 253, 320 -- all after smartclip's default 100-step
        gate, zclip's 25 and drytorch's 20 warm-up steps).

    Returns:
      ``(norms, spike_idx)``: float64 ``[n]`` positive norms and the int64
      spike indices (sorted as given).
    """
    rng = np.random.default_rng(seed)
    x = np.exp(noise * rng.standard_normal(n)).astype(np.float64)
    factors = np.asarray(factors, dtype=np.float64)
    if at is None:
        idx = np.round(np.linspace(0.3, 0.8, len(factors)) * n).astype(np.int64)
    else:
        idx = np.asarray(at, dtype=np.int64)
    if idx.shape != factors.shape:
        raise ValueError("`at` and `factors` must have the same length")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError("spike index out of range")
    x[idx] *= factors
    return x, idx


def regime_shift(
    n: int = 600, seed: int = 0, factor: float = 0.2, *, noise: float = 0.1
) -> np.ndarray:
    """A stationary stream whose level is multiplied by ``factor`` halfway.

    ``norms[t] = level[t] * exp(noise * N(0, 1))`` with ``level[t] = 1`` for
    ``t < n // 2`` and ``factor`` from step ``n // 2`` on. float64 ``[n]``.
    """
    rng = np.random.default_rng(seed)
    x = np.exp(noise * rng.standard_normal(n)).astype(np.float64)
    x[n // 2 :] *= factor
    return x


def constant(n: int = 200, value: float = 1.0) -> np.ndarray:
    """``n`` copies of ``value`` (float64)."""
    return np.full(n, value, dtype=np.float64)


def with_nan(norms: np.ndarray, at: int | Sequence[int] = 70, value: float = _NAN) -> np.ndarray:
    """A float64 copy of ``norms`` with ``value`` (default NaN; +inf works too) at ``at``."""
    out = np.array(norms, dtype=np.float64, copy=True)
    out[np.asarray(at)] = value
    return out
