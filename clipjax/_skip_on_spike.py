"""``skip_on_spike``: drop a whole step whose gradient norm or loss spikes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _conditional, _grouping, _kit, _xla
from clipjax._global_norm import global_norm
from clipjax._kit import SpikeFeedback
from clipjax._metrics import GroupInfo
from clipjax._stats import ring_mean_std, ring_push

ALGO = "skip_on_spike"
FEEDBACKS = get_args(SpikeFeedback)
ROUTES = ("fold", "select", "cond")


class ConditionalRouteWarning(UserWarning):
    """skip_on_spike runs an optimizer with full-size moments under ``lax.cond``.

    The step is correct but costs more than :func:`clipjax.adamw` passed
    directly, which folds the skip in (:doc:`/reference_skip_step`). Silence it
    with ``warnings.filterwarnings("ignore", category=clipjax.ConditionalRouteWarning)``.
    """


class SkipOnSpikeTransform(optax.GradientTransformationExtraArgs):
    """The transform :func:`clipjax.skip_on_spike` returns.

    An ``optax.GradientTransformationExtraArgs`` with one more attribute,
    ``route``: how a skipped step leaves the inner state as it was
    (``"fold"``, ``"select"`` or ``"cond"``).
    """

    route: _conditional.Route

    def __new__(
        cls, init: Callable[..., Any], update: Callable[..., Any], route: _conditional.Route
    ) -> SkipOnSpikeTransform:
        tx = super().__new__(cls, init, update)
        tx.route = route
        return tx

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self.init, self.update, self.route)


class SkipOnSpikeState(NamedTuple):
    """State of :func:`skip_on_spike`.

    Attributes:
      inner_state: the wrapped transform's state; unchanged by a skipped step.
      grad_norm_window: ``float32[window_size]`` ring buffer of the last
        global gradient norms observed (as ``feedback`` says).
      value_window: ``float32[window_size]`` the same for the losses.
      grad_norm_seen: ``int32`` norms ever written to ``grad_norm_window``.
      value_seen: ``int32`` the same for ``value_window``.
      metrics: ``[1]``-shaped arrays (group ``global``): ``grad_norm``,
        ``value``, ``grad_threshold``, ``value_threshold``, ``skipped``,
        ``skipped_count``, ``consecutive_skips``, ``nonfinite_count``,
        ``step`` (update calls) and ``count`` (taken steps).
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


def _threshold(window: jax.Array, seen: jax.Array, sigma: Any, min_history: int) -> jax.Array:
    """``mean + sigma * std`` (population std) of the window, or ``+inf`` below
    ``min_history`` values."""
    mean, std, held = ring_mean_std(window, seen, ddof=0)
    threshold = mean + jnp.asarray(sigma, window.dtype) * std
    return jnp.where(held >= min_history, threshold, jnp.inf).astype(window.dtype)


def _observation(
    x: jax.Array, threshold: jax.Array, skip: jax.Array, forced: jax.Array, feedback: str
) -> tuple[jax.Array, jax.Array]:
    """What a step teaches one buffer, ``(value, enters)``: the clippers' feedback
    rule, except that a forced step enters as it is."""
    fires = skip if feedback == "skip" else (x > threshold) & ~forced
    return _kit.observation(feedback, x, boundary=threshold, fires=fires)


def skip_on_spike(
    inner: optax.GradientTransformation,
    *,
    window_size: int | None = None,
    sigma: float = 6.0,
    min_history: int | None = None,
    max_consecutive_skips: int | None = None,
    feedback: SpikeFeedback = "clipped",
    axis_name: str | None = None,
    name: str | None = None,
) -> SkipOnSpikeTransform:
    """Skips a whole optimizer step when its gradient norm or loss spikes.

    Wraps a transform (usually the whole optimizer) like
    ``optax.apply_if_finite``. It keeps ring buffers of the last
    ``window_size`` global L2 norms ``g`` of the updates and losses (passed as
    ``update(..., value=loss)``). A step is **skipped** when ``g`` or the loss
    is not finite, or when a buffer holds ``min_history`` values and ``x >
    T_x = mean + sigma * std`` (population std). A skipped step returns zero
    updates and leaves the inner state bit-identical.

    ``feedback`` is what enters the buffers (never a NaN): ``min(x, T_x)``
    (``"clipped"``), ``x`` of taken steps (``"skip"``) or every ``x``
    (``"raw"``, OLMo-core's and Levanter's). After ``max_consecutive_skips``
    skips the next finite step is taken. How the inner transform skips
    (its ``route``: ``"fold"``, ``"select"`` or ``"cond"``):
    :doc:`/reference_skip_step`. ``window_size`` is static; every other number
    may be injected with ``optax.inject_hyperparams``.

    Static arguments: ``window_size`` (it sizes the buffers); every other number may be injected.

    Args:
      inner: the transform run on taken steps (e.g. ``clipjax.adamw(1e-3)``).
      window_size: how many observed steps the buffers remember (``>= 1``);
        default 128.
      sigma: how many standard deviations above the mean is a spike (> 0).
      min_history: buffered values before spikes are judged, an int in
        ``[1, window_size]``; default ``window_size // 2`` (at least 1).
      max_consecutive_skips: ``None`` (never force a step) or an int >= 1.
      feedback: ``"clipped"`` (default), ``"skip"`` or ``"raw"``.
      axis_name: under ``pmap``/``shard_map``, the mapped axis the norm and
        the loss are averaged over, so every replica takes the same decision.
      name: metrics prefix (default ``skip_on_spike``).

    Returns:
      A :class:`clipjax.SkipOnSpikeTransform` whose ``update(updates, state,
      params=None, *, value=None, **extra_args)`` passes ``value`` and the
      extra args on to ``inner``; its state is a :class:`SkipOnSpikeState`.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.skip_on_spike(optax.sgd(0.1), window_size=4, min_history=2)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> for loss in [1.0, 1.1, 0.9, 50.0]:
      ...     updates, state = tx.update({"w": jnp.ones(2)}, state, params, value=loss)
      >>> bool(state.metrics["skipped"][0]), updates["w"].tolist(), tx.route
      (True, [0.0, 0.0], 'cond')

    References:
      OLMo-core ``SkipStepOptimizer`` (allenai/OLMo-core); Levanter
      ``SkipStepConfig`` (stanford-crfm/levanter).
    """
    window_size, min_history = _checked(
        inner, window_size, sigma, min_history, max_consecutive_skips, feedback, name, axis_name
    )
    inner = optax.with_extra_args_support(inner)
    info = GroupInfo(algo=ALGO, name=name, groups=("global",))

    def init_fn(params: Any) -> Any:
        return SkipOnSpikeState(
            inner_state=inner.init(params),
            grad_norm_window=jnp.zeros((window_size,), jnp.float32),
            value_window=jnp.zeros((window_size,), jnp.float32),
            grad_norm_seen=jnp.zeros((), jnp.int32),
            value_seen=jnp.zeros((), jnp.int32),
            metrics=_initial_metrics(),
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
        _checks.check_state(state, SkipOnSpikeState, name or ALGO)
        norm, loss = norm_and_loss(updates, value, axis_name, name or ALGO)
        has_value = value is not None

        grad_threshold = _threshold(
            state.grad_norm_window, state.grad_norm_seen, sigma, min_history
        )
        # A norm whose float32 square overflows counts as non-finite: the gradient's
        # sum of squares overflowed, and so would an optimizer's second moment.
        finite = jnp.isfinite(norm * norm)
        spike = norm > grad_threshold
        if has_value:
            value_threshold = _threshold(state.value_window, state.value_seen, sigma, min_history)
            finite = finite & jnp.isfinite(loss)
            spike = spike | (loss > value_threshold)
        else:
            value_threshold = jnp.array(jnp.inf, jnp.float32)

        consecutive = state.metrics["consecutive_skips"][0]
        forced = jnp.zeros((), bool)
        if max_consecutive_skips is not None:
            forced = finite & spike & (consecutive >= max_consecutive_skips)
            spike = spike & ~forced
        skip = jnp.logical_not(finite) | spike
        take = _xla.computed_once(jnp.logical_not(skip))

        inner_args = dict(extra_args)
        if has_value:
            inner_args["value"] = value
        new_updates, inner_state = run_inner(
            tx.route, take, inner, updates, state.inner_state, params, name or ALGO, warned,
            **inner_args,
        )  # fmt: skip

        x, enters = _observation(norm, grad_threshold, skip, forced, feedback)
        grad_norm_window, grad_norm_seen = ring_push(
            state.grad_norm_window, state.grad_norm_seen, x, enters
        )
        if has_value:
            x, enters = _observation(loss, value_threshold, skip, forced, feedback)
            value_window, value_seen = ring_push(state.value_window, state.value_seen, x, enters)
        else:
            value_window, value_seen = _xla.returned((state.value_window, state.value_seen))

        skip1 = skip.reshape(1)
        metrics = _kit.step_metrics(
            state.metrics,
            norm=norm.reshape(1),
            observed=take.reshape(1),
            finite=finite.reshape(1),
            value=loss.reshape(1),
            grad_threshold=grad_threshold.reshape(1),
            value_threshold=value_threshold.reshape(1),
            skipped=skip1,
            skipped_count=state.metrics["skipped_count"] + skip1,
            consecutive_skips=jnp.where(skip1, state.metrics["consecutive_skips"] + 1, 0),
        )
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

    warned = [False]
    tx = wrapper(init_fn, update_fn, inner)
    return tx


def wrapper(init: Any, update: Any, inner: Any) -> SkipOnSpikeTransform:
    """A skipping wrapper around ``inner``, with the route :func:`run_inner` takes."""
    return SkipOnSpikeTransform(init, update, _conditional.route_of(inner))


def run_inner(
    route: _conditional.Route,
    take: jax.Array,
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any,
    who: str,
    warned: list[bool],
    **extra_args: Any,
) -> tuple[Any, Any]:
    """``inner``'s update where ``take`` holds, zero updates and its state as it
    was where not (by ``route``; ``warned`` holds whether it warned)."""
    if route == "cond" and not warned[0] and _has_full_size(inner_state, updates):
        warned[0] = True
        _warn_conditional(who)
    new_updates, new_state = _conditional.run_if(
        route, take, inner, updates, inner_state, params, **extra_args
    )
    # On a skipped step the updates passed through: zero them. The select fuses
    # into whatever consumes the updates (apply_updates), and, unlike a multiply
    # by 0, keeps a NaN gradient out. An inner update_if has zeroed them already.
    if route != "fold":
        new_updates = jax.tree.map(
            lambda u: jnp.where(take, u, jnp.zeros((), u.dtype)), new_updates
        )
    return new_updates, new_state


def _checked(
    inner: Any,
    window_size: Any,
    sigma: Any,
    min_history: Any,
    max_consecutive_skips: Any,
    feedback: Any,
    name: Any,
    axis_name: Any,
) -> tuple[int, int]:
    """Validates skip_on_spike's arguments; returns ``(window_size, min_history)``
    with their defaults (128, half the window) filled in."""
    check_inner(inner)
    window_size = 128 if window_size is None else window_size
    _checks.integer("window_size", window_size, 1)
    _checks.positive("sigma", sigma)
    if min_history is None:
        min_history = max(1, window_size // 2)
    _checks.integer("min_history", min_history, 1, static=False)
    concrete_history = _checks.concrete(min_history)
    if concrete_history is not None and concrete_history > window_size:
        raise ValueError(f"min_history must be <= window_size ({window_size}), got {min_history!r}")
    if max_consecutive_skips is not None:
        _checks.integer("max_consecutive_skips", max_consecutive_skips, 1, static=False)
    _checks.feedback(feedback, FEEDBACKS)
    _checks.name(name)
    if axis_name is not None and not isinstance(axis_name, (str, tuple)):
        raise ValueError(f"axis_name must be a str (or a tuple of str), got {axis_name!r}")
    return window_size, min_history


def _initial_metrics() -> dict[str, jax.Array]:
    fields = ("grad_norm", "value", "grad_threshold", "value_threshold", "skipped")
    counters = ("skipped_count", "consecutive_skips", "nonfinite_count", "step", "count")
    fill = {"grad_threshold": jnp.inf, "value_threshold": jnp.inf}
    return _kit.new_metrics(
        1, jnp.float32, fields, counters, grad_norm=jnp.nan, value=jnp.nan, **fill
    )


def norm_and_loss(
    updates: Any, value: Any, axis_name: Any, who: str
) -> tuple[jax.Array, jax.Array]:
    """The step's global gradient norm and loss (NaN without one), float32,
    averaged over ``axis_name``; an integer leaf or a non-scalar loss raise."""
    leaves, _, _ = _grouping.leaves_with_names(updates)
    _grouping.check_inexact(leaves, _grouping.make_grouping(updates, "global"), who)
    norm = global_norm(updates).astype(jnp.float32)
    loss = jnp.full((), jnp.nan, jnp.float32)
    if value is not None:
        if jnp.size(value) != 1:
            raise ValueError(f"value must be a scalar (the loss), got shape {jnp.shape(value)}")
        loss = jnp.asarray(value).astype(jnp.float32).reshape(())
    if axis_name is not None:
        norm = jax.lax.pmean(norm, axis_name)
        if value is not None:
            loss = jax.lax.pmean(loss, axis_name)
    return norm, loss


def _warn_conditional(who: str) -> None:
    warnings.warn(
        f"{who}: the inner transform has full-size state and no update_if, "
        "so a skipped step goes through lax.cond (route 'cond'), which costs about "
        "two extra passes over the updates per step. clipjax.adam, clipjax.adamw and "
        "clipjax.chain, passed directly (not inside optax.inject_hyperparams or "
        "optax.MultiSteps), fold the skip into the update instead (route 'fold').",
        ConditionalRouteWarning,
        stacklevel=3,
    )


def _has_full_size(state: Any, params: Any) -> bool:
    """Whether ``state`` holds a leaf shaped like a (non-scalar) parameter: moments."""
    shapes = {jnp.shape(x) for x in jax.tree.leaves(params) if jnp.size(x) > 1}
    return any(jnp.shape(x) in shapes for x in jax.tree.leaves(state))


def check_inner(inner: Any) -> None:
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return
    hint = ""
    if callable(inner):
        label = getattr(inner, "__qualname__", None) or type(inner).__name__
        hint = f" (the factory {label} itself? call it, e.g. {label}(1e-3))"
    raise TypeError(
        "skip_on_spike: inner must be an optax GradientTransformation, an object with "
        f"init and update, got {inner!r}{hint}"
    )
