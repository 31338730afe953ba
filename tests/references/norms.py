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
    """``exp(noise * N(0, 1))`` (median 1), times ``factors[i]`` at ``at[i]``: by default
    ``round(linspace(0.3, 0.8, len(factors)) * n)``, for n=400 steps 120, 187, 253, 320,
    all after smartclip's 100-step gate, zclip's 25 and drytorch's 20 warm-up steps.
    Returns ``(norms, spike_idx)``."""
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
    """``exp(noise * N(0, 1))`` times ``factor`` from step ``n // 2`` on."""
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
