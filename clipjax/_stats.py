"""Streaming statistics as pure functions on stacked ``[groups]`` arrays.

Each state's leaves lead with a ``[G]`` axis; ``*_update(state, x: [G])`` keeps
the state's structure, shapes and dtypes and assumes a finite ``x``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

# --------------------------------------------------------------------------
# Welford
# --------------------------------------------------------------------------


class WelfordState(NamedTuple):
    """Running mean and sum of squared deviations (Welford 1962).

    Attributes:
      count: int32 ``[G]``, observations seen.
      mean: ``[G]``, mean of the observations (0 when ``count == 0``).
      m2: ``[G]``, sum of squared deviations from the mean.
    """

    count: jax.Array
    mean: jax.Array
    m2: jax.Array


def welford_init(num_groups: int, dtype: DTypeLike = jnp.float32) -> WelfordState:
    """Empty Welford state for ``num_groups`` groups."""
    zeros = jnp.zeros((num_groups,), dtype)
    return WelfordState(jnp.zeros((num_groups,), jnp.int32), zeros, zeros)


def welford_update(state: WelfordState, x: ArrayLike) -> WelfordState:
    """``n += 1; δ = x - mean; mean += δ/n; m2 += δ·(x - mean_new)`` (smartclip's order)."""
    x = jnp.asarray(x, state.mean.dtype)
    count = state.count + 1
    delta = x - state.mean
    mean = state.mean + delta / count.astype(x.dtype)
    return WelfordState(count, mean, state.m2 + delta * (x - mean))


def welford_std(state: WelfordState) -> jax.Array:
    """Sample standard deviation (ddof=1); 0 with fewer than 2 observations."""
    n = state.count.astype(state.m2.dtype)
    var = jnp.maximum(state.m2 / jnp.maximum(n - 1, 1), 0)
    return jnp.where(state.count >= 2, jnp.sqrt(var), 0)


class SampleState(NamedTuple):
    """The running sums of a sample: enough for its mean and variance.

    Attributes:
      count: int32 ``[G]``, observations seen.
      total: ``[G]``, their sum.
      m2: ``[G]``, the sum of squared deviations from their mean.
    """

    count: jax.Array
    total: jax.Array
    m2: jax.Array


def sample_init(num_groups: int, dtype: DTypeLike = jnp.float32) -> SampleState:
    """An empty sample for ``num_groups`` groups (zeros, as :func:`welford_init`)."""
    return SampleState(*welford_init(num_groups, dtype))


def sample_update(state: SampleState, x: ArrayLike) -> SampleState:
    """Adds ``x``: ``m2 += (x - mean_before) * (x - mean_after)``, each mean ``total / count``."""
    dtype = state.total.dtype
    x = jnp.asarray(x, dtype)
    count = state.count + 1
    total = state.total + x
    before = jnp.where(state.count > 0, sample_mean(state), x)
    after = total / count.astype(dtype)
    return SampleState(count, total, state.m2 + (x - before) * (x - after))


def sample_mean(state: SampleState) -> jax.Array:
    """``total / count`` (0 for an empty sample)."""
    return state.total / jnp.maximum(state.count, 1).astype(state.total.dtype)


# --------------------------------------------------------------------------
# P² quantile
# --------------------------------------------------------------------------


class P2State(NamedTuple):
    """Five P² markers per group (Jain & Chlamtac 1985).

    Attributes:
      heights: ``[G, 5]`` marker heights; while ``count < 5`` the first
        ``count`` slots hold the raw observations in arrival order.
      positions: int32 ``[G, 5]`` marker positions (0-based ranks).
      desired: ``[G, 5]`` desired marker positions, advanced by
        ``[0, p/2, p, (1+p)/2, 1]`` per observation as smartclip does.
      count: int32 ``[G]``, observations seen.
    """

    heights: jax.Array
    positions: jax.Array
    desired: jax.Array
    count: jax.Array


def p2_init(num_groups: int, p: float = 0.5, dtype: DTypeLike = jnp.float32) -> P2State:
    """Empty P² state; ``p`` only fixes the desired positions set on the 5th value."""
    del p  # the desired positions are (re)set on the 5th observation
    return P2State(
        heights=jnp.zeros((num_groups, 5), dtype),
        positions=jnp.zeros((num_groups, 5), jnp.int32),
        desired=jnp.zeros((num_groups, 5), dtype),
        count=jnp.zeros((num_groups,), jnp.int32),
    )


def _p2_adjust(
    heights: jax.Array, positions: jax.Array, want: jax.Array, i: jax.Array, textbook: bool
) -> tuple[jax.Array, jax.Array]:
    """Move marker ``i`` one rank towards its desired position if it is due."""
    dtype = heights.dtype
    q_lo, q_i, q_hi = (jax.lax.dynamic_index_in_dim(heights, i + k, 1, False) for k in (-1, 0, 1))
    n_lo, n_i, n_hi = (jax.lax.dynamic_index_in_dim(positions, i + k, 1, False) for k in (-1, 0, 1))
    gap = jax.lax.dynamic_index_in_dim(want, i, 1, False) - n_i.astype(dtype)
    move = ((gap >= 1.0) & (n_hi - n_i > 1)) | ((gap <= -1.0) & (n_lo - n_i < -1))
    step = jnp.where(gap >= 1.0, 1, -1).astype(jnp.int32)
    d = step.astype(dtype)
    right, left = (n_hi - n_i).astype(dtype), (n_i - n_lo).astype(dtype)
    # smartclip falls back to linear when a neighbour shares the position; the
    # placeholder denominators only keep the unused branch finite.
    spaced = (right != 0) & (left != 0)
    right_, left_ = jnp.where(spaced, right, 1), jnp.where(spaced, left, 1)
    bracket = (left_ + d) * (q_hi - q_i) / right_ + (right_ - d) * (q_i - q_lo) / left_
    # Jain & Chlamtac's piecewise-parabolic formula has the 1/(n[i+1]-n[i-1])
    # factor, which clipjax uses; smartclip drops it (textbook=False, for comparison).
    factor = d / (right_ + left_) if textbook else d
    parabolic = q_i + factor * bracket
    q_nb = jnp.where(step > 0, q_hi, q_lo)
    n_step = jnp.where(step > 0, right, -left)
    linear = jnp.where(n_step == 0, q_i, q_i + d * (q_nb - q_i) / jnp.where(n_step == 0, 1, n_step))
    inside = spaced & (q_lo < parabolic) & (parabolic < q_hi)
    q_new = jnp.where(move, jnp.where(inside, parabolic, linear), q_i)
    at = jnp.arange(heights.shape[1]) == i
    heights = jnp.where(at, q_new[:, None], heights)
    positions = positions + jnp.where(at & move[:, None], step[:, None], 0)
    return heights, positions


_State = TypeVar("_State")


def _select(mask: jax.Array, new: _State, old: _State) -> _State:
    """Per-group ``where`` over two states whose leaves lead with ``[G]``."""
    expand = lambda a: mask.reshape(mask.shape + (1,) * (a.ndim - 1))
    return jax.tree.map(lambda a, b: jnp.where(expand(a), a, b), new, old)


def p2_update(state: P2State, x: ArrayLike, p: ArrayLike = 0.5, textbook: bool = True) -> P2State:
    """One P² step (Jain & Chlamtac 1985); ``textbook=False`` is smartclip's ``P2Quantile``."""
    heights, positions, desired, count = state
    dtype = heights.dtype
    x = jnp.asarray(x, dtype)
    p = jnp.asarray(p, dtype)
    slot = jnp.arange(5)
    zero, one = jnp.zeros_like(p), jnp.ones_like(p)
    increments = jnp.stack([zero, p / 2.0, p, (1.0 + p) / 2.0, one])
    initial = jnp.stack([zero, 2.0 * p, 4.0 * p, 2.0 + 2.0 * p, 4.0 * one])

    # Warm-up: keep the raw observations; the 5th one starts the markers.
    stored = jnp.where(slot == count[:, None], x[:, None], heights)
    started = P2State(
        jnp.sort(stored, axis=1),
        jnp.broadcast_to(slot.astype(jnp.int32), positions.shape),
        jnp.broadcast_to(initial, desired.shape),
        count + 1,
    )
    warm = _select(count == 4, started, P2State(stored, positions, desired, count + 1))

    # Steady state: an if/elif chain in smartclip, kept literal with nested where.
    q = heights
    below = [x < q[:, j] for j in range(4)]
    cell = jnp.where(below[0] | below[1], 0, jnp.where(below[2], 1, jnp.where(below[3], 2, 3)))
    q = q.at[:, 0].set(jnp.where(below[0], x, q[:, 0]))
    above = ~(below[0] | below[1] | below[2] | below[3]) & ~(x <= q[:, 4])
    q = q.at[:, 4].set(jnp.where(above, x, q[:, 4]))
    n = positions + (slot > cell[:, None]).astype(jnp.int32)
    want = desired + increments
    # Markers 1, 2, 3 in turn: each sees its neighbours already moved.
    q, n = jax.lax.fori_loop(
        1, 4, lambda i, qn: _p2_adjust(qn[0], qn[1], want, i, textbook), (q, n)
    )
    steady = P2State(q, n, want, count + 1)

    return _select(count < 5, warm, steady)


def p2_value(state: P2State) -> jax.Array:
    """Middle marker once ``count >= 5``; before that the exact median (0 if empty)."""
    count = state.count
    slot = jnp.arange(5)
    seen = jnp.sort(jnp.where(slot < count[:, None], state.heights, jnp.inf), axis=1)
    lo = jnp.clip((count - 1) // 2, 0, 4)
    hi = jnp.clip(count // 2, 0, 4)
    pick = lambda idx: jnp.take_along_axis(seen, idx[:, None], axis=1)[:, 0]
    median = (pick(lo) + pick(hi)) / 2
    return jnp.where(count >= 5, state.heights[:, 2], jnp.where(count == 0, 0, median))


# --------------------------------------------------------------------------
# EMA moments
# --------------------------------------------------------------------------


class EmaMomentsState(NamedTuple):
    """Exponential moving mean and variance (no bias correction).

    Attributes:
      count: int32 ``[G]``, observations seen.
      mean: ``[G]``, EMA of x, starting at the first observation.
      var: ``[G]``, EMA variance, starting at 0.
    """

    count: jax.Array
    mean: jax.Array
    var: jax.Array


def ema_moments_init(num_groups: int, dtype: DTypeLike = jnp.float32) -> EmaMomentsState:
    """Empty EMA moments state."""
    zeros = jnp.zeros((num_groups,), dtype)
    return EmaMomentsState(jnp.zeros((num_groups,), jnp.int32), zeros, zeros)


def ema_moments_update(state: EmaMomentsState, x: ArrayLike, decay: ArrayLike) -> EmaMomentsState:
    """``mean ← d·mean + (1-d)·x``, ``var ← d·var + d(1-d)·(x - mean_old)²`` (Finch 2009)."""
    x = jnp.asarray(x, state.mean.dtype)
    d = jnp.asarray(decay, x.dtype)
    dev = x - state.mean
    first = state.count == 0
    # mean + (1-d)·dev rounds once, where d·mean + (1-d)·x rounds at full
    # magnitude twice; equal in real arithmetic.
    mean = jnp.where(first, x, state.mean + (1 - d) * dev)
    var = jnp.where(first, 0, d * state.var + d * (1 - d) * dev * dev)
    return EmaMomentsState(state.count + 1, mean, var)


def ema_moments_std(state: EmaMomentsState) -> jax.Array:
    """``sqrt(max(var, 0))``."""
    return jnp.sqrt(jnp.maximum(state.var, 0))


# --------------------------------------------------------------------------
# Rolling window
# --------------------------------------------------------------------------


class WindowState(NamedTuple):
    """Last ``size`` observations per group, raw and sorted.

    Attributes:
      values: ``[G, size]`` ring buffer; observation ``k`` sits in slot ``k % size``.
      sorted: ``[G, size]`` the valid values in ascending order, ``+inf`` padded.
      count: int32 ``[G]``, observations seen in total.
    """

    values: jax.Array
    sorted: jax.Array
    count: jax.Array


def window_init(num_groups: int, size: int, dtype: DTypeLike = jnp.float32) -> WindowState:
    """Empty window of ``size`` slots per group."""
    return WindowState(
        jnp.zeros((num_groups, size), dtype),
        jnp.full((num_groups, size), jnp.inf, dtype),
        jnp.zeros((num_groups,), jnp.int32),
    )


def window_update(state: WindowState, x: ArrayLike) -> WindowState:
    """Push ``x``, evicting the oldest value once full; the sorted copy is kept by shifts."""
    values, ordered, count = state
    size = values.shape[1]
    x = jnp.asarray(x, values.dtype)
    slot = jnp.arange(size)
    head = count % size
    at_head = slot == head[:, None]
    evicted = jnp.where(count >= size, jnp.sum(jnp.where(at_head, values, 0), axis=1), jnp.inf)
    values, seen = ring_push(values, count, x)

    pad = jnp.full_like(ordered[:, :1], jnp.inf)
    gone = jnp.sum(ordered < evicted[:, None], axis=1, keepdims=True)
    ordered = jnp.where(slot < gone, ordered, jnp.concatenate([ordered[:, 1:], pad], axis=1))
    put = jnp.sum(ordered <= x[:, None], axis=1, keepdims=True)
    shifted = jnp.concatenate([pad, ordered[:, :-1]], axis=1)
    ordered = jnp.where(slot < put, ordered, jnp.where(slot == put, x[:, None], shifted))
    return WindowState(values, ordered, seen)


def window_percentile(state: WindowState, percentile: ArrayLike) -> jax.Array:
    """Linearly interpolated percentile of the window (numpy's and smartclip's; 0 if empty)."""
    ordered = state.sorted
    dtype = ordered.dtype
    n = jnp.minimum(state.count, ordered.shape[1])
    last = jnp.maximum(n - 1, 0)
    # percentile·(n-1) is exact for integral percentiles, so splitting it by
    # 100 keeps f to one rounding; a float32 pos = 0.99·(n-1) would carry an
    # absolute error of ~1e-5 into f (smartclip computes in float64).
    scaled = jnp.asarray(percentile, dtype) * last.astype(dtype)
    lo = jnp.clip(jnp.floor(scaled / 100.0).astype(jnp.int32), 0, last)
    frac = jnp.clip((scaled - 100.0 * lo.astype(dtype)) / 100.0, 0, 1)
    hi = jnp.minimum(lo + 1, last)
    empty = n == 0
    # Empty rows would read +inf padding; zero it so 0·inf never appears.
    left = jnp.where(empty, 0, jnp.take_along_axis(ordered, lo[:, None], axis=1)[:, 0])
    right = jnp.where(empty, 0, jnp.take_along_axis(ordered, hi[:, None], axis=1)[:, 0])
    value = jnp.where((frac == 0) | (lo == hi), left, (1.0 - frac) * left + frac * right)
    return jnp.where(empty, 0, value)


# --------------------------------------------------------------------------
# Streaming quantile
# --------------------------------------------------------------------------

# Chosen by simulation (q = 0.95, decay = 0.99, 200 seeds; see
# squantile_update): the raw iterate moves down by _SQ_GAIN·(1-decay)·scale
# per observation below it, and the reported value averages it at rate
# _SQ_AVERAGING·(1-decay).
_SQ_GAIN = 0.2
_SQ_AVERAGING = 0.125


class StreamingQuantileState(NamedTuple):
    """Scale-free stochastic-approximation quantile with Polyak averaging.

    Attributes:
      count: int32 ``[G]``, observations seen.
      estimate: ``[G]``, raw stochastic-approximation iterate ``r``.
      spread: ``[G]``, EMA of ``|x - r|`` (rate ``1 - decay``), uncorrected.
      spread_weight: ``[G]``, the same EMA of 1, which bias-corrects it.
      average: ``[G]``, EMA of ``r`` (rate ``(1 - decay)/8``), uncorrected.
      average_weight: ``[G]``, the same EMA of 1.
    """

    count: jax.Array
    estimate: jax.Array
    spread: jax.Array
    spread_weight: jax.Array
    average: jax.Array
    average_weight: jax.Array


def squantile_init(num_groups: int, dtype: DTypeLike = jnp.float32) -> StreamingQuantileState:
    """Empty streaming-quantile state."""
    zeros = jnp.zeros((num_groups,), dtype)
    return StreamingQuantileState(jnp.zeros((num_groups,), jnp.int32), *([zeros] * 5))


def squantile_update(
    state: StreamingQuantileState, x: ArrayLike, q: ArrayLike, decay: ArrayLike
) -> StreamingQuantileState:
    """Track the ``q``-quantile of a drifting stream.

    With ``a = 1 - decay``, ``p = clip(q, a, 1 - a)``, the bias-corrected
    spread ``s = EMA_a(|x - r|)`` and the first observation as start:

        r ← r + 0.2·a·s·(p - 1[x < r]) / min(p, 1 - p)     (Robbins-Monro)
        value = EMA_{a/8}(r), bias-corrected               (Polyak averaging)

    A stochastic gradient step of the pinball loss: scale-free, it goes down as
    well as up (unlike smartclip's ``EmaQuantile``) and forgets in ``O(1/a)`` steps.
    """
    dtype = state.estimate.dtype
    x = jnp.asarray(x, dtype)
    a = 1 - jnp.asarray(decay, dtype)
    p = jnp.clip(jnp.asarray(q, dtype), a, 1 - a)
    r = state.estimate
    weighted = state.spread_weight > 0
    scale = jnp.where(weighted, state.spread / jnp.where(weighted, state.spread_weight, 1), 0)
    gain = _SQ_GAIN * a / jnp.minimum(p, 1 - p)
    estimate = r + gain * scale * (p - (x < r).astype(dtype))
    # The step uses the spread of earlier observations only, so its size does
    # not depend on the side this x falls on.
    spread = (1 - a) * state.spread + a * jnp.abs(x - r)
    spread_weight = (1 - a) * state.spread_weight + a
    b = _SQ_AVERAGING * a
    average = (1 - b) * state.average + b * estimate
    average_weight = (1 - b) * state.average_weight + b
    first = state.count == 0
    zero = jnp.zeros_like(x)
    return StreamingQuantileState(
        state.count + 1,
        jnp.where(first, x, estimate),
        jnp.where(first, zero, spread),
        jnp.where(first, zero, spread_weight),
        jnp.where(first, zero, average),
        jnp.where(first, zero, average_weight),
    )


def squantile_value(state: StreamingQuantileState) -> jax.Array:
    """Bias-corrected average of the iterate; the first value until then, 0 if empty."""
    weighted = state.average_weight > 0
    average = state.average / jnp.where(weighted, state.average_weight, 1)
    return jnp.where(state.count == 0, 0, jnp.where(weighted, average, state.estimate))


# --------------------------------------------------------------------------
# Geometric quantile (Andrew et al. 2021)
# --------------------------------------------------------------------------


class GeometricQuantileState(NamedTuple):
    """The geometric quantile estimate.

    Attributes:
      count: int32 ``[G]``, observations seen (0: no estimate yet).
      quantile: ``[G]``, the estimate ``q`` (0 before the first observation).
    """

    count: jax.Array
    quantile: jax.Array


def gquantile_init(num_groups: int, dtype: DTypeLike = jnp.float32) -> GeometricQuantileState:
    """Empty geometric-quantile state."""
    return GeometricQuantileState(
        jnp.zeros((num_groups,), jnp.int32), jnp.zeros((num_groups,), dtype)
    )


def gquantile_update(
    state: GeometricQuantileState, x: ArrayLike, q: ArrayLike, lr: ArrayLike
) -> GeometricQuantileState:
    """``quantile <- quantile * exp(-lr * (1[x <= quantile] - q))`` (Andrew et al. 2021)."""
    dtype = state.quantile.dtype
    x = jnp.asarray(x, dtype)
    below = (x <= state.quantile).astype(dtype)
    moved = state.quantile * jnp.exp(-jnp.asarray(lr, dtype) * (below - jnp.asarray(q, dtype)))
    return GeometricQuantileState(state.count + 1, jnp.where(state.count == 0, x, moved))


# --------------------------------------------------------------------------
# Helpers of the clippers' statistics
# --------------------------------------------------------------------------


def positive_part(x: jax.Array, eps: ArrayLike) -> jax.Array:
    """smartclip's ``ensure_positive``: ``x if x > 0 else eps`` (a NaN becomes ``eps``)."""
    return jnp.where(x > 0, x, jnp.asarray(eps, x.dtype))


def ring_push(
    values: jax.Array, seen: jax.Array, x: jax.Array, enters: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Writes ``x`` into slot ``seen % size`` where ``enters``; the buffer and ``seen`` advanced."""
    size = values.shape[-1]
    at_slot = jnp.arange(size) == (seen % size)[..., None]
    if enters is not None:
        at_slot = at_slot & enters[..., None]
        seen = seen + enters.astype(seen.dtype)
    else:
        seen = seen + 1
    return jnp.where(at_slot, jnp.asarray(x, values.dtype)[..., None], values), seen


def ring_mean_std(
    values: jax.Array, seen: jax.Array, ddof: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean, std (``ddof``; 0 with ``n <= ddof``) and ``n = min(seen, size)`` of a ring buffer."""
    size = values.shape[-1]
    n = jnp.minimum(seen, size)
    valid = jnp.arange(size) < n[..., None]
    nf = jnp.maximum(n, 1).astype(values.dtype)
    mean = jnp.sum(jnp.where(valid, values, 0), axis=-1) / nf
    dev = jnp.where(valid, values - mean[..., None], 0)
    var = jnp.sum(dev * dev, axis=-1) / jnp.maximum(nf - ddof, 1)
    return mean, jnp.where(n > ddof, jnp.sqrt(var), 0), n


def window_mean_std(state: WindowState) -> tuple[jax.Array, jax.Array]:
    """Mean and sample std (ddof=1; 0 with fewer than 2 values) of the window."""
    mean, std, _ = ring_mean_std(state.values, state.count, ddof=1)
    return mean, std


class WarmupEmaState(NamedTuple):
    """EMA statistics that start from a warm-up sample.

    Attributes:
      mean: ``[G]`` running mean.
      var: ``[G]`` running variance.
      warmup: the warm-up sample's running sums (:class:`SampleState`).
    """

    mean: jax.Array
    var: jax.Array
    warmup: SampleState


@dataclasses.dataclass(frozen=True)
class WarmupEma:
    """EMA mean (and variance) started from the first ``warmup_steps`` observations.

    The observation that completes the warm-up sets ``mean`` and ``var`` to
    the sample's (``ddof=1``: only a positive variance, as drytorch's). Then,
    with ``a = alpha``, ``mean <- a mean + (1-a) x``, ``var <- a var + (1-a)
    (x - mean)**2`` with the new mean (``variance="after_mean"``, zclip's) or
    the old one (``"before_mean"``, drytorch's); ``None``: no variance.
    """

    alpha: ArrayLike = 0.97
    warmup_steps: ArrayLike = 0
    variance: str | None = "after_mean"
    ddof: int = 0
    start_var: float = 0.0

    def init(self, num_groups: int, dtype: DTypeLike) -> WarmupEmaState:
        return WarmupEmaState(
            jnp.zeros((num_groups,), dtype),
            jnp.full((num_groups,), self.start_var, dtype),
            sample_init(num_groups, dtype),
        )

    def observe(self, state: Any, x: jax.Array, count: jax.Array) -> Any:
        a = self.alpha
        warming = count < self.warmup_steps
        sample = sample_update(state.warmup, x)
        completes = count + 1 == self.warmup_steps
        n = sample.count.astype(sample.m2.dtype)  # >= 1: x was just added
        if self.ddof:
            # Undefined (NaN) with fewer than ddof + 1 values: the start value is kept.
            sample_var = sample.m2 / jnp.maximum(n - self.ddof, 1)
            sample_var = jnp.where(n > self.ddof, sample_var, jnp.nan)
            sample_var = jnp.where(sample_var > 0, sample_var, state.var)
        else:
            sample_var = sample.m2 / n
        mean = a * state.mean + (1 - a) * x
        if self.variance == "after_mean":
            var = a * state.var + (1 - a) * (x - mean) ** 2
        elif self.variance == "before_mean":
            var = a * state.var + (1 - a) * (x - state.mean) ** 2
        else:
            var = state.var
        mean = jnp.where(warming, jnp.where(completes, sample_mean(sample), state.mean), mean)
        var = jnp.where(warming, jnp.where(completes, sample_var, state.var), var)
        warmup = _select(warming, sample, state.warmup)
        return WarmupEmaState(mean, var, warmup)
