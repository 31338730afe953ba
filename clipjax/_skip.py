"""``skip_on_spike``: drop a whole step whose gradient norm or loss spikes."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from clipjax import _conditional, _grouping, _kit, _state_check, _validation
from clipjax._metrics import GroupInfo
from clipjax._static import global_norm
from clipjax._stats import ring_mean_std
from clipjax._types import SpikeFeedback

ALGO = "skip_on_spike"
FEEDBACKS = get_args(SpikeFeedback)
ROUTES = ("fold", "select", "cond")


class ConditionalRouteWarning(UserWarning):
    """skip_on_spike runs an optimizer with full-size moments under ``lax.cond``.

    The step is correct, but the conditional's boundary costs about two extra
    passes over the updates. :func:`clipjax.adam`, :func:`clipjax.adamw` and
    :func:`clipjax.chain` (also inside ``optax.inject_hyperparams`` or
    ``optax.MultiSteps``) fold the skip in instead. Silence it with
    ``warnings.filterwarnings("ignore", category=clipjax.ConditionalRouteWarning)``.
    """


class SkipOnSpikeTransform(optax.GradientTransformationExtraArgs):
    """The transform :func:`clipjax.skip_on_spike` returns.

    An ``optax.GradientTransformationExtraArgs`` with one more attribute,
    ``route``: how a skipped step leaves the inner transform's state as it
    was (``"fold"``, ``"select"`` or ``"cond"``, see
    :func:`clipjax.skip_on_spike`), or ``None`` while it is not known yet
    (an inner transform whose route its first ``update`` finds).
    """

    route: str | None = None


class SkipOnSpikeState(NamedTuple):
    """State of :func:`skip_on_spike`.

    Attributes:
      inner_state: the wrapped transform's state; unchanged by a skipped step.
      grad_norm_window: ``float32[window_size]`` ring buffer of the last
        ``window_size`` global gradient norms it observed (what enters is set
        by ``feedback``).
      value_window: ``float32[window_size]`` the same for the values (losses)
        of the steps that were given one.
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


def _threshold(window: jax.Array, seen: jax.Array, sigma: Any, min_history: int) -> jax.Array:
    """``mean + sigma * std`` (population std) of the window, or ``+inf`` below
    ``min_history`` values."""
    mean, std, held = ring_mean_std(window, seen, ddof=0)
    threshold = mean + jnp.asarray(sigma, window.dtype) * std
    return jnp.where(held >= min_history, threshold, jnp.inf).astype(window.dtype)


def _push(window: jax.Array, seen: jax.Array, x: jax.Array, enter: jax.Array) -> tuple[Any, Any]:
    """Writes ``x`` into the ring buffer where ``enter`` (a scalar bool)."""
    slot = seen % window.shape[0]
    new_window = window.at[slot].set(jnp.where(enter, x, window[slot]))
    return new_window, seen + enter.astype(seen.dtype)


def _observation(
    x: jax.Array, threshold: jax.Array, skip: jax.Array, forced: jax.Array, feedback: str
) -> tuple[jax.Array, jax.Array]:
    """What a step teaches one buffer: ``(value, enters)``, by the clippers' own
    feedback rule: under ``"clipped"`` a value above its threshold enters at the
    threshold, except on a forced step (a run of skips ends: the value is the new
    level); under ``"skip"`` a skipped step enters nothing. A non-finite value
    never enters."""
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
    ``optax.apply_if_finite``. Each step, it measures the global L2 norm ``g``
    of the incoming updates (accumulated in float32) and reads the loss passed
    as ``update(..., value=loss)``. It keeps ring buffers of the last
    ``window_size`` observed values of each. A step is **skipped** when ``g``
    or the loss is NaN or infinite, or when a buffer holds at least
    ``min_history`` values and ``x > T_x = mean + sigma * std`` (population std
    of the buffer) for ``x = g`` or ``x = loss``. A skipped step returns zero
    updates (each leaf keeps its dtype) and leaves the inner state
    bit-identical; any other step returns the inner transform's update.

    ``feedback`` says what each step teaches the buffers (a NaN or infinite
    value never enters):

    * ``"clipped"`` (default): every finite ``x`` enters as ``min(x, T_x)``,
      on taken and skipped steps alike. One spike then moves the statistics no
      more than a value at the threshold would, so it cannot open the door to
      the next one; and a lasting upward shift of the norm or the loss is
      learnt within a few dozen steps (the threshold climbs by a fraction of a
      std each step) instead of stalling training.
    * ``"skip"``: a skipped step enters nothing, a taken step enters ``x``.
      A lasting upward shift larger than ``sigma`` standard deviations then
      skips every later step: training stalls unless
      ``max_consecutive_skips`` is set (measured on a small language model
      whose norm shifts by itself: 411 of 600 steps skipped).
    * ``"raw"``: every finite ``x`` enters as it is, as OLMo-core, Levanter
      and MaxText do. A spike inflates the std and lets the next one through.

    With ``max_consecutive_skips=k``, the next finite step after ``k``
    consecutive skips (of any cause) is taken even if it spikes, and its
    values enter the buffers as they are, under every ``feedback``.
    Non-finite steps are always skipped.

    On a skipped step the inner transforms do not run, and
    :func:`clipjax.metrics` reports the clipjax transforms inside as idle:
    ``grad_norm`` 0, ``scale`` 1, ``clipped`` False, their thresholds,
    statistics and counters as they stand (the state itself is untouched).
    ``skip_on_spike/global/skipped`` says the step was skipped.

    The decision is made on device, and how the inner transform skips
    depends on what it is:

    * :func:`clipjax.adam`, :func:`clipjax.adamw` and :func:`clipjax.chain`
      (optax's optimizers and chain, with the same state) fold the decision
      into their moments element-wise (their ``update_if``); a taken step
      computes what optax computes, in the same order, and equals it up to
      the last bit of a fused multiply-add.
      ``skip_on_spike(clipjax.adamw(...))`` or
      ``skip_on_spike(clipjax.chain(clipjax.zclip(...), clipjax.adamw(...)))``
      then costs the gradient norm and nothing more: no conditional, no
      copy, one fused loop per leaf with ``apply_updates``;
    * an optax wrapper around them, ``optax.inject_hyperparams(clipjax.adamw)
      (learning_rate=...)`` or ``optax.MultiSteps(clipjax.adamw(...), k)``
      (or any transform that calls a :class:`clipjax.SkippableTransform`'s
      ``update``), folds too: the wrapper runs every step, the optimizer
      inside folds the decision in, and the wrapper's own state (its step
      count, hyperparameters, ``MultiSteps``' accumulated gradients) is
      selected. The result is exactly that of the conditional route (the
      state bit for bit, the taken updates up to the last bit of a fused
      multiply-add);
    * clipjax clippers run every step and have their small state selected;
    * any other transform (``optax.adamw(...)`` itself) runs under
      ``jax.lax.cond`` only on taken steps, and a skipped step passes the
      gradients through and zeroes them with a select that fuses into the
      parameter update. The compiled step copies no optimizer state, but the
      conditional's boundary costs about two extra passes over the updates.
      The step returns exactly the types the inner update returns (where
      ``optax.adam(mu_dtype=jnp.float32)`` turns bfloat16 gradients into
      float32 updates, a skipped step returns float32 zeros too), and a
      skipped step passes the inner state through cast to them, which
      changes nothing where the inner update keeps its state's dtypes.

    The returned transform says which route it took in its ``route``
    attribute: ``"fold"``, ``"select"`` or ``"cond"``. It is known at
    construction around a :class:`clipjax.SkippableTransform` or a clipjax
    clipper, and is otherwise found when ``update`` is first called (or
    traced), since only the inner update itself shows whether a
    ``SkippableTransform`` runs inside; until then it is ``None``. When the
    route is ``"cond"`` around an optimizer whose state holds full-size
    buffers (``optax.adam``), that first ``update`` warns with
    :class:`clipjax.ConditionalRouteWarning` (once: the route is found once
    per transform).

    Differences from ``optax.apply_if_finite``: a non-finite step is skipped
    even after ``max_consecutive_skips`` (``apply_if_finite`` applies it after
    ``max_consecutive_errors``); a finite gradient whose float32 sum of squares
    overflows counts as non-finite; spikes of finite values are skipped too;
    and the state's metrics say why.

    Compared with OLMo-core's ``SkipStepOptimizer`` and Levanter's skip-step
    wrapper (the defaults ``window_size=128``, ``sigma=6.0`` and
    ``min_history=window_size // 2`` are theirs, and ``feedback="raw"`` is
    their rule): a NaN loss never enters the buffers (OLMo-core's mean becomes
    NaN and every step is skipped until it leaves the window), the loss is
    optional, and every decision is in the state's metrics.

    Without ``value``, only the norm is watched: the value buffer stays empty,
    the ``value`` metric is NaN and ``value_threshold`` is ``+inf``. The
    thresholds are also ``+inf`` while a buffer holds fewer than
    ``min_history`` values. A buffer whose values are all equal has std 0: any
    larger value is then a spike.

    Static arguments: ``window_size`` (it sizes the buffers); every other number
    may be injected or scheduled with ``optax.inject_hyperparams``, with no
    ``static_args``.

    Args:
      inner: the transform to run on taken steps (an
        ``optax.GradientTransformation``, e.g. ``clipjax.adamw(1e-3)`` or
        ``optax.adamw(1e-3)``).
      window_size: how many observed steps the buffers remember (an int >= 1);
        default 128.
      sigma: how many standard deviations above the mean is a spike (> 0).
      min_history: the number of buffered values before spikes are judged, an
        int in ``[1, window_size]``; default ``window_size // 2`` (at least 1).
        Non-finite steps are skipped from the first step on.
      max_consecutive_skips: ``None`` (never force a step) or an int >= 1.
      feedback: ``"clipped"`` (default), ``"skip"`` or ``"raw"``: what each
        step teaches the buffers, above.
      axis_name: under ``pmap``/``shard_map`` with per-device gradients and
        losses, the mapped axis: the norm and the loss are averaged over it
        before the decision, so every replica takes the same decision. Needed
        whenever the replicas' inputs differ and ``inner`` holds a collective
        (e.g. a ``pmean`` of the updates): replicas that disagree would run
        different branches and the collective would never complete.
      name: metrics prefix (default ``skip_on_spike``).

    Returns:
      A :class:`clipjax.SkipOnSpikeTransform` (an
      ``optax.GradientTransformationExtraArgs`` with a ``route`` attribute)
      whose ``update(updates,
      state, params=None, *, value=None, **extra_args)`` takes the step's loss
      as ``value``; ``value`` and the other extra args are passed on to
      ``inner``. Its state, :class:`SkipOnSpikeState`, records under
      ``skip_on_spike/global/``: ``grad_norm``, ``value``,
      ``grad_threshold``, ``value_threshold``, ``skipped`` and the counters
      ``skipped_count`` (all skips), ``consecutive_skips``,
      ``nonfinite_count``, ``step`` (update calls) and ``count`` (taken
      steps); the inner state's clipjax metrics keep their own names.

    Raises:
      TypeError: ``inner`` is not a transform (e.g. the factory
        ``optax.adam`` itself, or None).
      ValueError: a hyperparameter is out of range, or, at ``update``, a
        gradient leaf is not a float array (the error names the leaf).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.skip_on_spike(optax.sgd(0.1), window_size=4, min_history=2)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> for loss in [1.0, 1.1, 0.9, 50.0]:
      ...     updates, state = tx.update({"w": jnp.ones(2)}, state, params, value=loss)
      >>> bool(state.metrics["skipped"][0]), updates["w"].tolist()
      (True, [0.0, 0.0])
      >>> tx.route
      'cond'
      >>> inner = optax.inject_hyperparams(clipjax.adamw)(learning_rate=1e-3)
      >>> tx = clipjax.skip_on_spike(inner)
      >>> tx.route is None
      True
      >>> _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
      >>> tx.route
      'fold'

    References:
      OLMo-core ``SkipStepOptimizer``
      (``olmo_core/optim/skip_step_optimizer.py``, allenai/OLMo-core);
      Levanter ``SkipStepConfig`` (``levanter/optim/skipstep.py``,
      stanford-crfm/levanter).
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
        _state_check.check_state(state, SkipOnSpikeState, name or ALGO)
        norm, loss = _norm_and_loss(updates, value, axis_name, name or ALGO)
        has_value = value is not None

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
        forced = jnp.zeros((), bool)
        if max_consecutive_skips is not None:
            forced = finite & spike & (consecutive >= max_consecutive_skips)
            spike = spike & ~forced
        skip = jnp.logical_not(finite) | spike
        take = _grouping.computed_once(jnp.logical_not(skip))

        inner_args = dict(extra_args)
        if has_value:
            inner_args["value"] = value
        route, new_updates, inner_state = _conditional.run_if_routed(
            take, inner, updates, state.inner_state, params, **inner_args
        )
        if tx.route != route:
            tx.route = route
            if route == "cond" and _has_full_size(state.inner_state, updates):
                _warn_conditional(name or ALGO)
        # On a skipped step the updates passed through: zero them. The select
        # fuses into whatever consumes the updates (apply_updates), and, unlike
        # a multiply by 0, keeps a NaN gradient out. An inner update_if has
        # zeroed them already.
        if getattr(inner, "update_if", None) is None:
            new_updates = jax.tree.map(
                lambda u: jnp.where(take, u, jnp.zeros((), u.dtype)), new_updates
            )

        x, enters = _observation(norm, grad_threshold, skip, forced, feedback)
        grad_norm_window, grad_norm_seen = _push(
            state.grad_norm_window, state.grad_norm_seen, x, enters
        )
        if has_value:
            x, enters = _observation(loss, value_threshold, skip, forced, feedback)
            value_window, value_seen = _push(state.value_window, state.value_seen, x, enters)
        else:
            # Copies, not the inputs themselves: an output that passes its input
            # through cannot reuse that input's donated buffer.
            value_window, value_seen = jnp.copy(state.value_window), jnp.copy(state.value_seen)

        metrics = _step_metrics(
            state.metrics, norm, loss, grad_threshold, value_threshold, skip, finite, take
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

    tx = SkipOnSpikeTransform(init_fn, update_fn)
    if getattr(inner, "update_if", None) is not None:
        tx.route = "fold"
    elif isinstance(inner, _kit.ClipTransform):
        tx.route = "select"
    return tx


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
    _check_inner(inner)
    window_size = 128 if window_size is None else window_size
    _validation.integer("window_size", window_size, 1)
    _validation.positive("sigma", sigma)
    if min_history is None:
        min_history = max(1, window_size // 2)
    _validation.integer("min_history", min_history, 1, static=False)
    concrete_history = _validation.concrete(min_history)
    if concrete_history is not None and concrete_history > window_size:
        raise ValueError(f"min_history must be <= window_size ({window_size}), got {min_history!r}")
    if max_consecutive_skips is not None:
        _validation.integer("max_consecutive_skips", max_consecutive_skips, 1, static=False)
    _kit.check_feedback(feedback, FEEDBACKS)
    _kit.check_name(name)
    if axis_name is not None and not isinstance(axis_name, (str, tuple)):
        raise ValueError(f"axis_name must be a str (or a tuple of str), got {axis_name!r}")
    return window_size, min_history


def _initial_metrics() -> dict[str, jax.Array]:
    f32 = lambda x: jnp.full((1,), x, jnp.float32)
    i32 = lambda: jnp.zeros((1,), jnp.int32)
    return {
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


def _norm_and_loss(
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


def _step_metrics(
    old: dict[str, jax.Array],
    norm: jax.Array,
    loss: jax.Array,
    grad_threshold: jax.Array,
    value_threshold: jax.Array,
    skip: jax.Array,
    finite: jax.Array,
    take: jax.Array,
) -> dict[str, jax.Array]:
    one = jnp.ones((1,), jnp.int32)
    skip1 = skip.reshape(1)
    return {
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


def _warn_conditional(who: str) -> None:
    warnings.warn(
        f"{who}: the inner transform has full-size state and no update_if, "
        "so a skipped step goes through lax.cond (route 'cond'), which costs about "
        "two extra passes over the updates per step. clipjax.adam, clipjax.adamw and "
        "clipjax.chain (also inside optax.inject_hyperparams or optax.MultiSteps) "
        "fold the skip into the update instead (route 'fold').",
        ConditionalRouteWarning,
        stacklevel=3,
    )


def _has_full_size(state: Any, params: Any) -> bool:
    """Whether ``state`` holds a leaf shaped like a (non-scalar) parameter: moments."""
    shapes = {jnp.shape(x) for x in jax.tree.leaves(params) if jnp.size(x) > 1}
    return any(jnp.shape(x) in shapes for x in jax.tree.leaves(state))


def _check_inner(inner: Any) -> None:
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
