"""Percentiles of magnitudes ``|x|``: an exact sort and a radix histogram select.

Both compute numpy's default ``"linear"`` percentile (Hyndman & Fan type 7); the
radix select and its error bound: docs/glossary.md (Approximate percentile).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clipjax import _grouping

Array = jax.Array
Values = Array | Sequence[Array]

#: ``method="auto"`` sorts up to this many elements and uses the radix
#: histogram above. Chosen from ``benchmarks/percentile.py`` on a 2-core CPU
#: (its timings are on the "clip_by_percentile" section of
#: ``benchmarks/RESULTS.md``): the sort is the faster method for the smallest
#: leaves, both stay around a millisecond up to 2^12 elements, and above that
#: the sort falls behind by orders of magnitude, so ``auto`` keeps the exact
#: result where it is cheap. (On GPU the sort is fast and the histogram passes
#: are a few kernel launches each; the threshold is not critical there.)
AUTO_EXACT_MAX_SIZE = 2**12

#: Histogram size of one radix pass (``log2(bins)`` bits resolved per pass).
DEFAULT_BINS = 2**12

# Leaves smaller than this are concatenated into one array before the radix
# passes over a union of leaves (scope "global"/"per_layer"), so that thousands
# of small leaves cost one scatter, not thousands.
_CONCAT_MAX_SIZE = 2**16

_MIN_BINS = 2**11
_MAX_BINS = 2**20


class _Layout:
    """Bit layout of a float dtype's magnitudes."""

    def __init__(self, dtype: Any) -> None:
        dtype = jnp.dtype(dtype)
        if dtype == jnp.float64:
            self.int_dtype, self.total, self.exponent = jnp.int64, 63, 11
        else:
            self.int_dtype, self.total, self.exponent = jnp.int32, 31, 8
        self.inf_key = ((1 << self.exponent) - 1) << (self.total - self.exponent)
        self.tiny = float(jnp.finfo(dtype).tiny)


def _check_bins(bins: int, passes: int | None) -> int:
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)):
        raise ValueError(f"bins must be a power of two in [{_MIN_BINS}, {_MAX_BINS}], got {bins!r}")
    if not _MIN_BINS <= bins <= _MAX_BINS or bins & (bins - 1):
        raise ValueError(f"bins must be a power of two in [{_MIN_BINS}, {_MAX_BINS}], got {bins!r}")
    if passes is not None and (
        isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1
    ):
        raise ValueError(f"passes must be an int >= 1 or None, got {passes!r}")
    return int(bins).bit_length() - 1


def default_passes(bins: int = DEFAULT_BINS, dtype: Any = jnp.float32) -> int:
    """The passes :func:`approx_percentile` makes by default: >= 16 mantissa bits."""
    bits = _check_bins(bins, None)
    layout = _Layout(_stats_dtype_of(dtype))
    return max(1, -(-(layout.exponent + 16) // bits))


def approx_relative_error(
    bins: int = DEFAULT_BINS, passes: int | None = None, dtype: Any = jnp.float32
) -> float:
    """The relative error bound ``eps`` of :func:`approx_percentile`.

    ``|approx - exact| <= eps·exact + tiny + 4 ulp(exact)`` (:doc:`/glossary`);
    ``eps = 0`` when the passes resolve every bit.

    Examples:
      >>> from clipjax import approx_relative_error
      >>> approx_relative_error()  # 4096 bins, two passes, float32: 2**-17
      7.62939453125e-06
      >>> approx_relative_error(bins=2**16, passes=2)
      0.0
    """
    bits = _check_bins(bins, passes)
    layout = _Layout(_stats_dtype_of(dtype))
    if passes is None:
        passes = default_passes(bins, dtype)
    resolved = min(layout.total, passes * bits)
    if resolved == layout.total:
        return 0.0
    return 2.0 ** -(resolved - layout.exponent + 1)


def _stats_dtype_of(dtype: Any) -> jnp.dtype:
    return _grouping.norm_dtype([jnp.zeros((), dtype)])


def _as_list(values: Values) -> list[Array]:
    if isinstance(values, (list, tuple)):
        return [jnp.asarray(x) for x in values]
    return [jnp.asarray(values)]


def _is_static(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) or (
        isinstance(value, np.ndarray) and value.shape == ()
    )


def _rank(n: int, percentile: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """``(lo, hi, gamma)`` of numpy's linear method; Python numbers when static."""
    if _is_static(percentile):
        q = float(percentile) / 100.0
        v = (n - 1) * q  # numpy's "linear" virtual index, same float64 ops
        if v >= n - 1:
            return n - 1, n - 1, 0.0
        if v < 0 or math.isnan(v):
            return 0, 0, 0.0
        lo = math.floor(v)
        return lo, lo + 1, v - lo
    q = jnp.asarray(percentile, dtype) / 100
    v = jnp.clip((n - 1) * q, 0, n - 1)
    floor = jnp.floor(v)
    lo = floor.astype(jnp.int32)
    return lo, jnp.minimum(lo + 1, n - 1), v - floor


def _lerp(a: Array, b: Array, gamma: Any) -> Array:
    # numpy's _lerp: the b-side formula for gamma >= 0.5 keeps the result monotone.
    diff = b - a
    return jnp.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)


def _magnitudes(x: Array, dtype: Any) -> Array:
    return jnp.abs(x).astype(dtype).reshape(-1)


def _exact(arrays: list[Array], n: int, percentile: Any, dtype: Any) -> tuple[Array, Array]:
    flat = [_magnitudes(x, dtype) for x in arrays if x.size]
    ordered = jnp.sort(flat[0] if len(flat) == 1 else jnp.concatenate(flat))
    lo, hi, gamma = _rank(n, percentile, dtype)
    # NaN sorts last, so the last element is finite only if all are.
    finite = jnp.isfinite(ordered[-1])
    if _is_static(lo) and lo == hi:
        return ordered[lo], finite
    return _lerp(ordered[lo], ordered[hi], jnp.asarray(gamma, dtype)), finite


def _chunks(arrays: list[Array], dtype: Any) -> list[Array]:
    """Flat magnitudes; small arrays concatenated into one."""
    small = [_magnitudes(x, dtype) for x in arrays if 0 < x.size < _CONCAT_MAX_SIZE]
    large = [_magnitudes(x, dtype) for x in arrays if x.size >= _CONCAT_MAX_SIZE]
    if len(small) > 1:
        small = [jnp.concatenate(small)]
    return small + large


def _radix(
    arrays: list[Array], n: int, percentile: Any, dtype: Any, bits: int, passes: int
) -> tuple[Array, Array]:
    layout = _Layout(dtype)
    int_dtype = layout.int_dtype
    # abs() cleared the sign bit: keys are non-negative and ordered like |x|.
    keys = [jax.lax.bitcast_convert_type(x, int_dtype) for x in _chunks(arrays, dtype)]
    lo, hi, gamma = _rank(n, percentile, dtype)
    # One order statistic is enough when the rank is a static integer.
    single = _is_static(lo) and (lo == hi or gamma == 0.0)
    ranks = [jnp.asarray(lo, int_dtype)] + ([] if single else [jnp.asarray(hi, int_dtype)])
    prefix = [jnp.zeros((), int_dtype) for _ in ranks]  # top bits resolved so far
    below = [jnp.zeros((), jnp.int32) for _ in ranks]  # elements in lower buckets
    nonfinite = None
    resolved = 0
    for step in range(passes):
        width = min(bits, layout.total - resolved)
        if width <= 0:
            break
        shift = layout.total - resolved - width
        size = 1 << width
        if step == 0:
            # Every element is in the (empty-prefix) bucket of both ranks.
            hist = jnp.zeros((size,), jnp.int32)
            for k in keys:
                hist = hist.at[k >> shift].add(1, mode="promise_in_bounds")
            hists = [hist] * len(ranks)
            # inf/NaN keys start at a digit boundary (width >= exponent bits).
            nonfinite = jnp.sum(hist[layout.inf_key >> shift :])
        else:
            hist = jnp.zeros((2 * size + 1,), jnp.int32)
            for k in keys:
                digit = (k >> shift) & (size - 1)
                top = k >> (shift + width)
                slot = jnp.where(top == prefix[0], digit, 2 * size)
                if not single:
                    slot = jnp.where((top == prefix[1]) & (top != prefix[0]), size + digit, slot)
                hist = hist.at[slot].add(1, mode="promise_in_bounds")
            hists = [hist[:size]]
            if not single:
                # When both ranks share a bucket its counts are all in the first half.
                hists.append(jnp.where(prefix[0] == prefix[1], hist[:size], hist[size : 2 * size]))
        for r, h in enumerate(hists):
            cumulative = below[r] + jnp.cumsum(h)
            digit_r = jnp.sum(cumulative <= ranks[r], dtype=jnp.int32)
            below[r] = below[r] + jnp.sum(jnp.where(jnp.arange(size) < digit_r, h, 0))
            prefix[r] = (prefix[r] << width) | digit_r.astype(int_dtype)
        resolved += width
    remaining = layout.total - resolved
    estimates = []
    for p in prefix:
        low = jax.lax.bitcast_convert_type(p << remaining, dtype)
        if remaining == 0:
            estimates.append(low)
        else:
            high_key = (p << remaining) | ((1 << remaining) - 1)
            high = jax.lax.bitcast_convert_type(high_key, dtype)
            estimates.append(low + (high - low) * 0.5)
    if single:
        value = estimates[0]
    else:
        value = _lerp(estimates[0], estimates[1], jnp.asarray(gamma, dtype))
    return value, nonfinite == 0


def select(
    values: Values,
    percentile: Any,
    method: str,
    bins: int = DEFAULT_BINS,
    passes: int | None = None,
) -> tuple[Array, Array]:
    """``(percentile of |values|, all values finite)`` of an array or several (empty: 0)."""
    arrays = _as_list(values)
    dtype = _grouping.norm_dtype(arrays)
    n = sum(int(x.size) for x in arrays)
    if n == 0:
        return jnp.zeros((), dtype), jnp.ones((), bool)
    if method == "auto":
        method = "exact" if n <= AUTO_EXACT_MAX_SIZE else "approx"
    if method == "exact":
        return _exact(arrays, n, percentile, dtype)
    if method != "approx":
        raise ValueError(f"method must be one of ('auto', 'exact', 'approx'), got {method!r}")
    bits = _check_bins(bins, passes)
    if passes is None:
        passes = default_passes(bins, dtype)
    return _radix(arrays, n, percentile, dtype, bits, passes)


def _public(value: Array, finite: Array) -> Array:
    return jnp.where(finite, value, jnp.nan)


def exact_percentile(values: Values, percentile: Any) -> Array:
    """The exact linearly interpolated percentile of ``|values|``, by sorting.

    Args:
      values: an array of any shape, or a sequence of arrays (their union);
        computed in float32 (float64 for float64 input).
      percentile: in ``[0, 100]``, a number or a scalar array.

    Returns:
      ``np.percentile(np.abs(values), percentile)``; NaN if any value is non-finite, 0 if none.

    Examples:
      >>> import jax.numpy as jnp
      >>> from clipjax import exact_percentile
      >>> float(exact_percentile(jnp.array([-4.0, 1.0, 2.0, -3.0]), 50.0))
      2.5
    """
    return _public(*select(values, percentile, "exact"))


def approx_percentile(
    values: Values, percentile: Any, *, bins: int = DEFAULT_BINS, passes: int | None = None
) -> Array:
    """The percentile of ``|values|`` by radix histogram select, with an error bound.

    Reads the data ``passes`` times (one scatter-add histogram of ``bins``
    counters each) instead of sorting. The result satisfies ``|approx - exact|
    <= eps·exact + tiny + 4 ulp(exact)`` with ``eps =
    approx_relative_error(bins, passes, dtype)`` (:doc:`/glossary`).

    Args:
      values: an array of any shape, or a sequence of arrays (their union,
        without concatenating the large ones).
      percentile: in ``[0, 100]``, a number or a scalar array.
      bins: counters per pass, a power of two in ``[2**11, 2**20]``.
      passes: number of passes; default enough for 16 mantissa bits (2 for
        float32, 3 for float64 with 4096 bins).

    Returns:
      A float32 scalar (float64 for float64 input); NaN if any value is non-finite, 0 if none.

    Examples:
      >>> import jax.numpy as jnp
      >>> from clipjax import approx_percentile
      >>> x = jnp.linspace(-1.0, 1.0, 100_001)
      >>> round(float(approx_percentile(x, 90.0)), 4)
      0.9
    """
    return _public(*select(values, percentile, "approx", bins, passes))
