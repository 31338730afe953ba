"""``skip_on_spike``: drop a whole step whose gradient norm or loss spikes."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _validation
from clipjax._metrics import GroupInfo
from clipjax._static import global_norm

ALGO = "skip_on_spike"


class SkipOnSpikeState(NamedTuple):
    """State of :func:`skip_on_spike`.

    Attributes:
      inner_state: the wrapped transform's state; unchanged by a skipped step.
      grad_norm_window: ``float32[window_size]`` ring buffer of the global
        gradient norms of the last accepted steps.
      value_window: ``float32[window_size]`` ring buffer of the values
        (losses) of the last accepted steps that were given one.
      grad_norm_seen: ``int32`` number of norms ever written to
        ``grad_norm_window`` (its next slot is ``grad_norm_seen % window_size``).
      value_seen: ``int32`` the same for ``value_window``.
      metrics: ``dict`` of ``[1]``-shaped arrays (group ``global``): the
        step's ``grad_norm``, ``value``, ``grad_threshold``,
        ``value_threshold``, ``skipped``, and the counters ``skipped_count``,
        ``consecutive_skips``, ``nonfinite_count``, ``step``, ``count``.
      info: static names, ``GroupInfo(algo="skip_on_spike", ...)``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.skip_on_spike(optax.sgd(0.1)).init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.SkipOnSpikeState), state.info.groups
      (True, ('global',))
    """

    inner_state: Any
    grad_norm_window: jax.Array
    value_window: jax.Array
    grad_norm_seen: jax.Array
    value_seen: jax.Array
    metrics: dict[str, jax.Array]
    info: GroupInfo


def _window_stats(window: jax.Array, seen: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean, population std and size of the values held in a ring buffer."""
    size = window.shape[0]
    held = jnp.minimum(seen, size)
    # The ring fills slots 0, 1, ... first, so the held values are the first `held`.
    mask = jnp.arange(size) < held
    n = jnp.maximum(held, 1).astype(window.dtype)
    mean = jnp.sum(jnp.where(mask, window, 0.0)) / n
    var = jnp.sum(jnp.where(mask, jnp.square(window - mean), 0.0)) / n
    return mean, jnp.sqrt(var), held


def _threshold(window: jax.Array, seen: jax.Array, sigma: Any, min_history: int) -> jax.Array:
    """``mean + sigma * std`` of the window, or ``+inf`` below ``min_history`` values."""
    mean, std, held = _window_stats(window, seen)
    threshold = mean + jnp.asarray(sigma, window.dtype) * std
    return jnp.where(held >= min_history, threshold, jnp.inf).astype(window.dtype)


def _push(window: jax.Array, seen: jax.Array, x: jax.Array, take: jax.Array) -> tuple[Any, Any]:
    slot = seen % window.shape[0]
    new_window = window.at[slot].set(jnp.where(take, x, window[slot]))
    return new_window, seen + take.astype(seen.dtype)


def skip_on_spike(
    inner: optax.GradientTransformation,
    *,
    window_size: int = 128,
    sigma: float = 6.0,
    min_history: int | None = None,
    max_consecutive_skips: int | None = None,
    axis_name: str | None = None,
    name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Skips a whole optimizer step when its gradient norm or loss spikes.

    Wraps a transform (usually the whole optimizer) like
    ``optax.apply_if_finite``. Each step, it measures the global L2 norm ``g``
    of the incoming updates (accumulated in float32) and reads the loss passed
    as ``update(..., value=loss)``. It keeps ring buffers of the last
    ``window_size`` *accepted* finite values of each. A step is **skipped**
    when ``g`` or the loss is NaN or infinite, or when a buffer holds at least
    ``min_history`` values and ``x > mean + sigma * std`` (population std of
    the buffer) for ``x = g`` or ``x = loss``. A skipped step returns zero
    updates (each leaf keeps its dtype), leaves the inner state bit-identical
    and adds nothing to the buffers; any other step runs ``inner`` and adds its
    norm (and loss, when given) to the buffers.

    With ``max_consecutive_skips=k``, the next finite step after ``k``
    consecutive skips (of any cause) is taken and observed even if it spikes,
    so a lasting shift of scale cannot stall training: the buffers then learn
    the new level. Non-finite steps are always skipped. Without it, a lasting
    upward shift larger than ``sigma`` standard deviations stops training
    (every step is skipped; ``consecutive_skips`` shows it).

    The decision is made on device with ``jax.lax.cond``: a taken step costs
    the inner update plus one read of the gradients (for the norm); a skipped
    step does not run ``inner`` at all.

    Compared with OLMo-core's ``SkipStepOptimizer`` and Levanter's skip-step
    wrapper (the defaults ``window_size=128``, ``sigma=6.0`` and
    ``min_history=window_size // 2`` are theirs), which store every step's
    loss and norm in their windows: here a skipped step never enters the
    buffers, so one spike does not inflate the std and let the next spike
    through, and a NaN loss does not poison the window (OLMo-core's mean
    becomes NaN and every step is skipped until it leaves the window). They
    also require the loss and report nothing; here the loss is optional and
    every decision is in the state's metrics.

    Without ``value``, only the norm is watched: the value buffer stays empty,
    the ``value`` metric is NaN and ``value_threshold`` is ``+inf``. The
    thresholds are also ``+inf`` while a buffer holds fewer than
    ``min_history`` values. A buffer whose values are all equal has std 0: any
    larger value is then a spike.

    Args:
      inner: the transform to run on taken steps.
      window_size: how many accepted steps the buffers remember (an int >= 1).
      sigma: how many standard deviations above the mean is a spike (> 0).
      min_history: the number of buffered values before spikes are judged, an
        int in ``[1, window_size]``; default ``window_size // 2`` (at least 1).
        Non-finite steps are skipped from the first step on.
      max_consecutive_skips: ``None`` (never force a step) or an int >= 1.
      axis_name: under ``pmap``/``shard_map`` with per-device gradients and
        losses, the mapped axis: the norm and the loss are averaged over it
        before the decision, so every replica takes the same decision. Needed
        whenever the replicas' inputs differ and ``inner`` holds a collective
        (e.g. a ``pmean`` of the updates): replicas that disagree would run
        different branches and the collective would never complete.
      name: metrics prefix (default ``skip_on_spike``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(updates,
      state, params=None, *, value=None, **extra_args)`` takes the step's loss
      as ``value``; ``value`` and the other extra args are passed on to
      ``inner``. Its state, :class:`SkipOnSpikeState`, records under
      ``skip_on_spike/global/``: ``grad_norm``, ``value``,
      ``grad_threshold``, ``value_threshold``, ``skipped`` and the counters
      ``skipped_count`` (all skips), ``consecutive_skips``,
      ``nonfinite_count``, ``step`` (update calls) and ``count`` (taken
      steps); the inner state's clipjax metrics keep their own names.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.skip_on_spike(optax.sgd(0.1), window_size=4, min_history=2)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> for loss in [1.0, 1.1, 0.9, 50.0]:
      ...     updates, state = tx.update({"w": jnp.ones(2)}, state, params, value=loss)
      >>> bool(state.metrics["skipped"][0]), updates["w"].tolist()
      (True, [0.0, 0.0])

    References:
      OLMo-core ``SkipStepOptimizer``
      (``olmo_core/optim/skip_step_optimizer.py``, allenai/OLMo-core);
      Levanter ``SkipStepConfig`` (``levanter/optim/skipstep.py``,
      stanford-crfm/levanter).
    """
    _validation.integer("window_size", window_size, 1)
    _validation.positive("sigma", sigma)
    if min_history is None:
        min_history = max(1, window_size // 2)
    _validation.integer("min_history", min_history, 1)
    if min_history > window_size:
        raise ValueError(f"min_history must be <= window_size ({window_size}), got {min_history!r}")
    if max_consecutive_skips is not None:
        _validation.integer("max_consecutive_skips", max_consecutive_skips, 1)
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError(f"name must be a non-empty str or None, got {name!r}")
    if axis_name is not None and not isinstance(axis_name, (str, tuple)):
        raise ValueError(f"axis_name must be a str (or a tuple of str), got {axis_name!r}")

    inner = optax.with_extra_args_support(inner)
    info = GroupInfo(algo=ALGO, name=name, groups=("global",))

    def init_fn(params: Any) -> Any:
        f32 = lambda x: jnp.full((1,), x, jnp.float32)
        i32 = lambda: jnp.zeros((1,), jnp.int32)
        metrics = {
            "grad_norm": f32(jnp.nan),
            "value": f32(jnp.nan),
            "grad_threshold": f32(jnp.inf),
            "value_threshold": f32(jnp.inf),
            "skipped": jnp.zeros((1,), jnp.bool_),
            "skipped_count": i32(),
            "consecutive_skips": i32(),
            "nonfinite_count": i32(),
            "step": i32(),
            "count": i32(),
        }
        return SkipOnSpikeState(
            inner_state=inner.init(params),
            grad_norm_window=jnp.zeros((window_size,), jnp.float32),
            value_window=jnp.zeros((window_size,), jnp.float32),
            grad_norm_seen=jnp.zeros((), jnp.int32),
            value_seen=jnp.zeros((), jnp.int32),
            metrics=metrics,
            info=info,
        )

    def update_fn(
        updates: Any,
        state: Any,
        params: Any = None,
        *,
        value: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, Any]:
        norm = global_norm(updates).astype(jnp.float32)
        has_value = value is not None
        loss = jnp.full((), jnp.nan, jnp.float32)
        if has_value:
            if jnp.size(value) != 1:
                raise ValueError(f"value must be a scalar (the loss), got shape {jnp.shape(value)}")
            loss = jnp.asarray(value).astype(jnp.float32).reshape(())
        if axis_name is not None:
            norm = jax.lax.pmean(norm, axis_name)
            if has_value:
                loss = jax.lax.pmean(loss, axis_name)

        grad_threshold = _threshold(
            state.grad_norm_window, state.grad_norm_seen, sigma, min_history
        )
        finite = jnp.isfinite(norm)
        spike = norm > grad_threshold
        if has_value:
            value_threshold = _threshold(state.value_window, state.value_seen, sigma, min_history)
            finite = finite & jnp.isfinite(loss)
            spike = spike | (loss > value_threshold)
        else:
            value_threshold = jnp.array(jnp.inf, jnp.float32)

        consecutive = state.metrics["consecutive_skips"][0]
        if max_consecutive_skips is not None:
            spike = spike & (consecutive < max_consecutive_skips)
        skip = jnp.logical_not(finite) | spike
        take = jnp.logical_not(skip)

        inner_args = dict(extra_args)
        if has_value:
            inner_args["value"] = value

        def taken(inner_state: Any) -> tuple[Any, Any]:
            return inner.update(updates, inner_state, params, **inner_args)

        def skipped(inner_state: Any) -> tuple[Any, Any]:
            return jax.tree.map(jnp.zeros_like, updates), inner_state

        new_updates, inner_state = jax.lax.cond(skip, skipped, taken, state.inner_state)

        grad_norm_window, grad_norm_seen = _push(
            state.grad_norm_window, state.grad_norm_seen, norm, take
        )
        if has_value:
            value_window, value_seen = _push(state.value_window, state.value_seen, loss, take)
        else:
            # Copies, not the inputs themselves: an output that passes its input
            # through cannot reuse that input's donated buffer.
            value_window, value_seen = jnp.copy(state.value_window), jnp.copy(state.value_seen)

        old = state.metrics
        one = jnp.ones((1,), jnp.int32)
        skip1 = skip.reshape(1)
        metrics = {
            "grad_norm": norm.reshape(1),
            "value": loss.reshape(1),
            "grad_threshold": grad_threshold.reshape(1),
            "value_threshold": value_threshold.reshape(1),
            "skipped": skip1,
            "skipped_count": old["skipped_count"] + skip1.astype(jnp.int32),
            "consecutive_skips": jnp.where(skip1, old["consecutive_skips"] + one, 0),
            "nonfinite_count": old["nonfinite_count"]
            + jnp.logical_not(finite).reshape(1).astype(jnp.int32),
            "step": old["step"] + one,
            "count": old["count"] + take.reshape(1).astype(jnp.int32),
        }
        new_state = SkipOnSpikeState(
            inner_state=inner_state,
            grad_norm_window=grad_norm_window,
            value_window=value_window,
            grad_norm_seen=grad_norm_seen,
            value_seen=value_seen,
            metrics=metrics,
            info=state.info,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
