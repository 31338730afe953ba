"""AXLearn's ``skip_and_clip_by_global_norm`` and its drop rules (``optimizers.py``, 34aed43)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast, get_args

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _grouping, _kit, _metrics, _skip_on_spike, _xla
from clipjax._kit import SpikeFeedback
from clipjax._metrics import GroupInfo
from clipjax._skip_on_spike import SkipOnSpikeTransform

ALGO = "skip_and_clip_by_global_norm"
_COUNTERS = ("skipped_count", "nonfinite_count", "clipped_count", "step", "count")
# count, mean, stddev -> {threshold name: threshold}: AXLearn's DropNormThresholdFn.
DropNormFn = Callable[..., dict[str, Any]]


def _multipliers(multipliers: Any) -> tuple[float, ...]:
    if not isinstance(multipliers, (tuple, list)) or not multipliers:
        raise ValueError(f"multipliers must be a non-empty tuple of numbers, got {multipliers!r}")
    for k in multipliers:
        _checks.positive("multipliers", k)
    return tuple(multipliers)


def drop_norm_by_grad_norm_ema(multipliers: tuple[float, ...] = (20, 40, 100)) -> DropNormFn:
    """AXLearn's drop thresholds ``k * mean``, one per multiplier ``k``.

    For :func:`skip_and_clip_by_global_norm`'s ``drop_norm``: a step is dropped
    when its norm reaches ``k`` times the (bias-corrected) EMA of the norms, for
    the smallest ``k``; each threshold counts its own exceedances, named
    ``count_exceeds_{k}x_mean``.

    Args:
      multipliers: the factors ``k`` (each ``> 0``).

    Returns:
      ``fn(count=, mean=, stddev=) -> {"20x_mean": 20 * mean, ...}``.

    Examples:
      >>> import clipjax
      >>> rule = clipjax.drop_norm_by_grad_norm_ema((2, 5))
      >>> {k: float(v) for k, v in rule(count=3, mean=1.5, stddev=0.1).items()}
      {'2x_mean': 3.0, '5x_mean': 7.5}

    References:
      AXLearn ``drop_norm_by_grad_norm_ema`` (apple/axlearn,
      ``axlearn/common/optimizers.py``, commit 34aed43).
    """
    multipliers = _multipliers(multipliers)

    def fn(count: Any, mean: Any, stddev: Any) -> dict[str, Any]:
        del count, stddev
        return {f"{k}x_mean": mean * k for k in multipliers}

    return fn


def drop_norm_by_grad_norm_stddev(
    *, min_count: int = 500, multipliers: tuple[float, ...] = (20, 40, 100)
) -> DropNormFn:
    """AXLearn's drop thresholds ``mean + k * stddev``, once ``min_count`` norms were seen.

    For :func:`skip_and_clip_by_global_norm`'s ``drop_norm``: with fewer than
    ``min_count`` observed norms nothing is dropped for its size (the threshold
    is +inf); then a step is dropped when its norm reaches
    ``mean + k * stddev`` of the EMAs for the smallest ``k``. The counters are
    named ``count_exceeds_{k}x_stddev``.

    Args:
      min_count: the observations before any threshold applies (an int ``>= 0``).
      multipliers: the factors ``k`` (each ``> 0``).

    Returns:
      ``fn(count=, mean=, stddev=) -> {"20x_stddev": ..., ...}``.

    Examples:
      >>> import clipjax
      >>> rule = clipjax.drop_norm_by_grad_norm_stddev(min_count=10, multipliers=(6,))
      >>> float(rule(count=9, mean=1.0, stddev=0.1)["6x_stddev"])
      inf
      >>> round(float(rule(count=10, mean=1.0, stddev=0.1)["6x_stddev"]), 6)
      1.6

    References:
      AXLearn ``drop_norm_by_grad_norm_stddev`` (apple/axlearn,
      ``axlearn/common/optimizers.py``, commit 34aed43).
    """
    _checks.integer("min_count", min_count, static=False)
    multipliers = _multipliers(multipliers)

    def fn(count: Any, mean: Any, stddev: Any) -> dict[str, Any]:
        mean, stddev = jnp.asarray(mean), jnp.asarray(stddev)
        return {
            f"{k}x_stddev": jnp.where(jnp.asarray(count) < min_count, jnp.inf, mean + stddev * k)
            for k in multipliers
        }

    return fn


class SkipAndClipState(NamedTuple):
    """State of :func:`skip_and_clip_by_global_norm`.

    Attributes:
      inner_state: the wrapped transform's state; unchanged by a dropped step.
      mean: ``float32[1]`` the bias-corrected EMA of the observed norms
        (AXLearn's ``grad_norm_ema``).
      var: ``float32[1]`` their EMA variance, ``grad_norm_square_ema - mean**2``
        kept by a recursion that does not cancel.
      metrics: ``dict`` of ``[1]`` arrays (group ``global``): ``grad_norm``,
        ``threshold`` (``max_norm``), ``scale``, ``clipped``, ``drop_norm``,
        ``skipped``, one ``count_exceeds_{name}`` per drop threshold, and the
        counters ``skipped_count``, ``nonfinite_count``, ``clipped_count``,
        ``step``, ``count`` (the observed norms).
      info: static names, ``GroupInfo(algo="skip_and_clip_by_global_norm")``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.skip_and_clip_by_global_norm(optax.sgd(0.1), drop_norm=100.0)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> sorted(k for k in state.metrics if k.startswith("count_exceeds"))
      ['count_exceeds_drop_norm']
    """

    inner_state: Any
    mean: jax.Array
    var: jax.Array
    metrics: dict[str, jax.Array]
    info: GroupInfo

    def statistics(self) -> dict[str, jax.Array]:
        """The statistics :func:`clipjax.metrics` reports: ``mean`` and ``std``."""
        return {"mean": self.mean, "std": _metrics.sqrt(self.var)}


def _threshold_names(drop_norm: Any) -> tuple[str, ...]:
    """The names of ``drop_norm``'s thresholds."""
    if drop_norm is None:
        return ()
    if not callable(drop_norm):
        _checks.positive("drop_norm", drop_norm)
        return ("drop_norm",)
    one = jnp.ones((), jnp.float32)
    try:
        names = drop_norm(count=one, mean=one, stddev=one)
    except TypeError as error:
        raise ValueError(
            "drop_norm must be a number or a function (count=, mean=, stddev=) -> "
            f"{{name: threshold}}, such as clipjax.drop_norm_by_grad_norm_ema(); calling "
            f"{drop_norm!r} failed: {error}"
        ) from None
    if not isinstance(names, dict) or not names or not all(isinstance(k, str) for k in names):
        raise ValueError(
            "drop_norm must return a non-empty dict {name: threshold} with str names, "
            f"got {names!r}"
        )
    return tuple(names)


def skip_and_clip_by_global_norm(
    inner: optax.GradientTransformation,
    *,
    drop_norm: float | DropNormFn | None = None,
    max_norm: float | None = None,
    grad_norm_ema_decay: float | None = None,
    eps: float = 1e-8,
    feedback: SpikeFeedback = "skip",
    axis_name: str | None = None,
    name: str | None = None,
) -> SkipOnSpikeTransform:
    """AXLearn's skip-and-clip: drop a step whose global norm reaches ``drop_norm``, else clip.

    With ``g`` the global L2 norm of the updates (float32), each step::

        dropped  if g is NaN or infinite, or g >= D for any threshold D of drop_norm
        else     inner(updates * min(1, max_norm / (g + eps)))

    A dropped step returns zero updates and leaves ``inner``'s state as it was.
    ``drop_norm`` is a number or a rule over bias-corrected EMAs (decay
    ``grad_norm_ema_decay``) of the observed norms ``x``:
    :func:`drop_norm_by_grad_norm_ema` or :func:`drop_norm_by_grad_norm_stddev`.
    ``feedback`` sets ``x``: the norm of taken steps only (``"skip"``,
    AXLearn's; a lasting rise then drops every later step), ``min(g, D)``
    (``"clipped"``) or every finite ``g`` (``"raw"``). Differences from
    AXLearn: :doc:`/defences`. A rule ``drop_norm`` goes in
    ``static_args``; every number may be injected.

    Static arguments: ``drop_norm`` when it is a rule (name it in static_args); every other
    number may be injected.

    Args:
      inner: the transform run on taken steps (``clipjax.adamw(...)`` folds).
      drop_norm: None (only non-finite steps are dropped), a number ``> 0``, or
        a rule ``(count=, mean=, stddev=) -> {name: threshold}``.
      max_norm: clip taken steps to this global norm (``> 0``); None: no clip
        (then ``drop_norm`` is required).
      grad_norm_ema_decay: the EMAs' decay, in (0, 1); required with a rule.
      eps: added to ``g`` in the clip's denominator (``>= 0``).
      feedback: ``"skip"`` (default), ``"clipped"`` or ``"raw"``.
      axis_name: average ``g`` over this mapped axis first.
      name: metrics prefix (default ``skip_and_clip_by_global_norm``).

    Returns:
      A :class:`clipjax.SkipOnSpikeTransform` (its ``route`` says how a drop
      leaves ``inner``'s state); state :class:`SkipAndClipState`, metrics under
      ``skip_and_clip_by_global_norm/global/``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.skip_and_clip_by_global_norm(
      ...     clipjax.adamw(1e-3), drop_norm=clipjax.drop_norm_by_grad_norm_ema((5,)),
      ...     max_norm=1.0, grad_norm_ema_decay=0.9)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> for g in [0.5, 0.6, 0.55, 40.0]:
      ...     updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
      >>> m = clipjax.metrics(state)
      >>> bool(m["skip_and_clip_by_global_norm/global/skipped"]), updates["w"].tolist()
      (True, [0.0, 0.0])
      >>> int(m["skip_and_clip_by_global_norm/global/count_exceeds_5x_mean"]), tx.route
      (1, 'fold')

    References:
      AXLearn ``skip_and_clip_by_global_norm`` (apple/axlearn,
      ``axlearn/common/optimizers.py``, commit 34aed43).
    """
    _skip_on_spike.check_inner(inner)
    names = _threshold_names(drop_norm)
    adaptive = callable(drop_norm)
    if adaptive and grad_norm_ema_decay is None:
        raise ValueError(
            "grad_norm_ema_decay must be set (e.g. 0.99) when drop_norm is a rule over the "
            "norm's EMAs"
        )
    if grad_norm_ema_decay is not None:
        _checks.open_unit("grad_norm_ema_decay", grad_norm_ema_decay)
    if max_norm is not None:
        _checks.positive("max_norm", max_norm)
    _checks.non_negative("eps", eps)
    _checks.feedback(feedback, get_args(SpikeFeedback))
    _checks.name(name)
    if axis_name is not None and not isinstance(axis_name, (str, tuple)):
        raise ValueError(f"axis_name must be a str (or a tuple of str), got {axis_name!r}")
    if drop_norm is None and max_norm is None:
        raise ValueError(
            f"{name or ALGO}: drop_norm and max_norm are both None, so no finite step would "
            "be dropped or clipped: set drop_norm (a number, or a rule such as "
            "clipjax.drop_norm_by_grad_norm_ema()), max_norm, or both; to drop only "
            "non-finite steps use optax.apply_if_finite"
        )
    inner = optax.with_extra_args_support(inner)
    who = name or ALGO
    decay = 0.0 if grad_norm_ema_decay is None else grad_norm_ema_decay

    def init_fn(params: Any) -> Any:
        one = lambda value: jnp.full((1,), value, jnp.float32)
        fields = ("grad_norm", "threshold", "scale", "clipped", "drop_norm", "skipped")
        exceeds = tuple(f"count_exceeds_{n}" for n in names)
        metrics = _kit.new_metrics(
            1, jnp.float32, fields, exceeds + _COUNTERS, threshold=jnp.inf, drop_norm=jnp.inf
        )
        return SkipAndClipState(
            inner_state=inner.init(params),
            mean=one(0.0),
            var=one(0.0),
            metrics=metrics,
            info=_kit.group_info(params, "global", ALGO, name),
        )

    def update_fn(
        updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        _checks.check_state(state, SkipAndClipState, who)
        grouping = _grouping.make_grouping(updates, "global")
        grouping.check_matches(state.info.leaves, state.info.shapes, who)
        g, _ = _skip_on_spike.norm_and_loss(updates, None, axis_name, who)
        g = g.reshape(1)
        finite = jnp.isfinite(g * g)  # as skip_on_spike: a norm whose square overflows
        count = state.metrics["count"]
        mean, var = state.mean, state.var

        # The drop thresholds from the statistics before this step (none before
        # the first observation: AXLearn's EMAs start at 1 and would judge it).
        if adaptive:
            std = jnp.sqrt(var)  # the recursion keeps var >= 0
            found = cast(DropNormFn, drop_norm)(count=count, mean=mean, stddev=std)
            bounds = {n: jnp.asarray(found[n], jnp.float32).reshape(1) for n in names}
            bounds = {n: jnp.where(count == 0, jnp.inf, b) for n, b in bounds.items()}
        else:
            bounds = {n: jnp.full((1,), cast(float, drop_norm), jnp.float32) for n in names}
        exceeds = {n: finite & (g >= b) for n, b in bounds.items()}
        boundary = jnp.full((1,), jnp.inf, jnp.float32)
        for b in bounds.values():
            boundary = jnp.minimum(boundary, b)
        dropped = finite & (g >= boundary)
        skip = ~finite | dropped
        take = _xla.computed_once(~skip[0])

        scale = jnp.ones((1,), jnp.float32)
        clipped_updates = updates
        if max_norm is not None:
            # The clip of a taken step (AXLearn's); a dropped step applies none.
            scale = jnp.where(skip, 1.0, jnp.minimum(1.0, max_norm / (g + eps)))
            factor = _xla.computed_once(scale[0])
            clipped_updates = jax.tree.map(lambda u: u * factor.astype(jnp.result_type(u)), updates)
        new_updates, inner_state = _skip_on_spike.run_inner(
            tx.route, take, inner, clipped_updates, state.inner_state, params, who, warned,
            **extra_args,
        )  # fmt: skip

        # What the EMAs learn (AXLearn's _moment, with the variance kept directly).
        x, observed = _kit.observation(feedback, g, boundary=boundary, fires=dropped)
        if adaptive:
            c = count.astype(jnp.float32)
            d = decay * (1 - decay**c) / (1 - decay ** (c + 1))
            new_mean = d * mean + (1 - d) * x
            new_var = d * var + d * (1 - d) * (x - mean) ** 2
            mean = jnp.where(observed, new_mean, mean)
            var = jnp.where(observed, new_var, var)
        else:
            mean, var = _xla.returned((mean, var))

        metrics = _kit.step_metrics(
            state.metrics,
            norm=g,
            observed=observed,
            threshold=jnp.full((1,), jnp.inf if max_norm is None else max_norm, jnp.float32),
            scale=scale,
            finite=finite,
            drop_norm=boundary,
            skipped=skip,
            skipped_count=state.metrics["skipped_count"] + skip,
            **{
                f"count_exceeds_{n}": state.metrics[f"count_exceeds_{n}"] + e
                for n, e in exceeds.items()
            },
        )
        new_state = SkipAndClipState(inner_state, mean, var, metrics, state.info)
        return new_updates, new_state

    warned = [False]
    tx = _skip_on_spike.wrapper(init_fn, update_fn, inner)
    return tx
