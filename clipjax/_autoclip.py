"""autoclip: smartclip's AutoClip (P² median + Welford std, or a percentile)."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, cast

import jax
import jax.numpy as jnp

from clipjax import _checks, _kit, _stats
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform, Feedback
from clipjax._metrics import GroupInfo

AutoClipMode = Literal["auto", "percentile"]
AutoClipHistory = Literal["all", "window", "ema", "geometric"]


class AutoClipState(NamedTuple):
    """State of :func:`autoclip`: its history's statistics per group (None where unused).

    Attributes:
      median: ``history="all"``: the P² markers of the median
        (:class:`clipjax._stats.P2State`).
      moments: ``history="all"``: Welford's sums for the std
        (:class:`clipjax._stats.WelfordState`).
      window: ``history="window"``: the last ``window_size`` observations
        (:class:`clipjax._stats.WindowState`).
      quantile: ``history="ema"``: the forgetting quantile
        (:class:`clipjax._stats.StreamingQuantileState`); ``"geometric"``:
        the geometric quantile (:class:`clipjax._stats.GeometricQuantileState`).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.autoclip().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.AutoClipState), state.info.groups
      (True, ('global',))
      >>> state.median.heights.shape, state.window is None
      ((1, 5), True)
    """

    median: _stats.P2State | None
    moments: _stats.WelfordState | None
    window: _stats.WindowState | None
    quantile: _stats.StreamingQuantileState | _stats.GeometricQuantileState | None
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


AUTO_HISTORIES = ("all", "window")
PERCENTILE_HISTORIES = ("window", "ema", "geometric")
# Auto mode's window: long enough for a stable median and std, short enough to
# follow a change of level within about 50 steps.
AUTO_WINDOW = 100


def _no_effect(
    mode: str, history: str, percentile: Any, window_size: Any, ema_decay: Any, quantile_lr: Any
) -> None:
    """A ValueError for an argument the chosen mode and history never read (given at all)."""
    unused = []
    if mode == "auto" and percentile is not None:
        unused.append(("percentile", percentile))
    if history != "window" and window_size is not None:
        unused.append(("window_size", window_size))
    if history != "ema" and ema_decay is not None:
        unused.append(("ema_decay", ema_decay))
    if history != "geometric" and quantile_lr is not None:
        unused.append(("quantile_lr", quantile_lr))
    for arg, value in unused:
        raise ValueError(
            f"{arg}={value!r} has no effect with mode={mode!r}, history={history!r}; "
            "leave it out, or choose the mode and history that use it"
        )


class _Settings(NamedTuple):
    """autoclip's arguments checked, with their defaults filled in."""

    mode: AutoClipMode
    history: AutoClipHistory
    window_size: int
    percentile: float
    ema_decay: float
    quantile_lr: float
    feedback: Feedback  # what the statistics learn ("clipped" is "raw" in percentile mode)
    ceiling: Any  # max_grad_norm resolved, or None
    gate: Any  # finite observations a group needs before it may be clipped
    eps: Any


def _checked(
    mode: Any, percentile: Any, history: Any, window_size: Any, ema_decay: Any,
    warmup_steps: Any, min_history: Any, eps: Any, feedback: Any, quantile_lr: Any,
    max_grad_norm: Any,
) -> _Settings:  # fmt: skip
    """Validates autoclip's arguments and fills in their defaults."""
    _checks.choice("mode", mode, ("auto", "percentile"))
    if mode == "auto":
        if history is None:
            history = "all" if feedback == "observe_first" else "window"
        if history in PERCENTILE_HISTORIES and history not in AUTO_HISTORIES:
            raise ValueError(
                f'history={history!r} is a percentile-mode history; mode="auto" takes '
                f"history in {AUTO_HISTORIES} (smartclip accepts history={history!r} in auto "
                "mode and ignores it, keeping the whole history: that is "
                'history="all"). For a streaming quantile use mode="percentile".'
            )
        _checks.choice("history", history, AUTO_HISTORIES)
        default_window = AUTO_WINDOW
    else:
        history = "window" if history is None else history
        _checks.choice("history", history, PERCENTILE_HISTORIES)
        default_window = 1024
    _no_effect(mode, history, percentile, window_size, ema_decay, quantile_lr)
    window_size = default_window if window_size is None else window_size
    percentile = 95.0 if percentile is None else percentile
    ema_decay = 0.99 if ema_decay is None else ema_decay
    quantile_lr = 0.2 if quantile_lr is None else quantile_lr
    _checks.percentile("percentile", percentile)
    _checks.integer("window_size", window_size, minimum=1)
    _checks.open_unit("ema_decay", ema_decay)
    _checks.positive("quantile_lr", quantile_lr)
    _checks.feedback(feedback, ("observe_first", "raw", "clipped", "skip"))
    ceiling = _kit.resolve_ceiling(max_grad_norm, feedback)
    warmup_steps, min_history = _kit.gate_defaults(feedback, warmup_steps, min_history)
    _checks.integer("warmup_steps", warmup_steps, static=False)
    _checks.integer("min_history", min_history, static=False)
    _checks.positive("eps", eps)
    if mode == "percentile":
        # A quantile is a rank statistic: a spike moves it by one rank at most,
        # while feeding it its own threshold only drags it down.
        if feedback == "skip":
            raise ValueError(
                'feedback="skip" is not available with mode="percentile": a p-quantile '
                "threshold fires on 1 - p of the steps by design, and never observing "
                'them drags it down without bound; use feedback="clipped" (judge first, '
                "observe the norm)"
            )
        if feedback == "clipped":
            feedback = "raw"
    gate = jnp.maximum(warmup_steps, min_history)
    return _Settings(
        mode, cast(AutoClipHistory, history), window_size, percentile, ema_decay, quantile_lr,
        cast(Feedback, feedback), ceiling, gate, eps,
    )  # fmt: skip


class _Stats(NamedTuple):
    """autoclip's statistics, the first four fields of its state."""

    median: _stats.P2State | None = None
    moments: _stats.WelfordState | None = None
    window: _stats.WindowState | None = None
    quantile: _stats.StreamingQuantileState | _stats.GeometricQuantileState | None = None


def _stats_init(s: _Settings, num_groups: int, dtype: Any) -> _Stats:
    """New statistics of ``s.history``."""
    if s.history == "all":
        median = _stats.p2_init(num_groups, 0.5, dtype)
        return _Stats(median=median, moments=_stats.welford_init(num_groups, dtype))
    if s.history == "window":
        return _Stats(window=_stats.window_init(num_groups, s.window_size, dtype))
    if s.history == "ema":
        return _Stats(quantile=_stats.squantile_init(num_groups, dtype))
    return _Stats(quantile=_stats.gquantile_init(num_groups, dtype))


def _observe(s: _Settings, stats: _Stats, x: jax.Array) -> _Stats:
    """The statistics after one observation per group, floored at ``eps``."""
    x = _stats.positive_part(x, s.eps)
    if s.history == "all":
        assert stats.median is not None and stats.moments is not None
        return _Stats(
            median=_stats.p2_update(stats.median, x, 0.5),
            moments=_stats.welford_update(stats.moments, x),
        )
    if s.history == "window":
        assert stats.window is not None
        return _Stats(window=_stats.window_update(stats.window, x))
    q, p = stats.quantile, s.percentile / 100.0
    if s.history == "ema":
        q = cast(_stats.StreamingQuantileState, q)
        return _Stats(quantile=_stats.squantile_update(q, x, p, s.ema_decay))
    q = cast(_stats.GeometricQuantileState, q)
    return _Stats(quantile=_stats.gquantile_update(q, x, p, s.quantile_lr))


def _report(s: _Settings, stats: _Stats) -> dict[str, jax.Array]:
    """``median`` and ``std`` (auto), or ``quantile`` (percentile), of the statistics."""
    if s.history == "all":
        assert stats.median is not None and stats.moments is not None
        median = _stats.p2_value(stats.median)
        return {"median": median, "std": _stats.welford_std(stats.moments)}
    if s.mode == "auto":
        window = stats.window
        assert window is not None
        median = _stats.window_percentile(window, 50.0)
        return {"median": median, "std": _stats.window_mean_std(window)[1]}
    if s.history == "window":
        assert stats.window is not None
        return {"quantile": _stats.window_percentile(stats.window, s.percentile)}
    if s.history == "ema":
        q = cast(_stats.StreamingQuantileState, stats.quantile)
        return {"quantile": _stats.squantile_value(q)}
    return {"quantile": cast(_stats.GeometricQuantileState, stats.quantile).quantile}


def _threshold(s: _Settings, values: dict[str, jax.Array]) -> jax.Array:
    """``max(eps, median + 3 std)`` (auto) or ``max(eps, quantile)`` (percentile)."""
    raw = values["median"] + 3.0 * values["std"] if s.mode == "auto" else values["quantile"]
    return jnp.maximum(raw, s.eps)


def autoclip(
    mode: AutoClipMode = "auto",
    percentile: float | None = None,
    history: AutoClipHistory | None = None,
    window_size: int | None = None,
    ema_decay: float | None = None,
    *,
    scope: Scope = "global",
    warmup_steps: int | None = None,
    min_history: int | None = None,
    eps: float = 1e-8,
    guard_nans: bool = True,
    feedback: Feedback = "observe_first",
    quantile_lr: float | None = None,
    max_grad_norm: float | Literal["auto"] | None = "auto",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """AutoClip: clip to a threshold learnt from the history of gradient norms.

    Per step and group, with ``g`` the norm (smartclip's ``AutoClip`` under
    the default ``feedback="observe_first"``)::

        observe g (floored at eps), then
        T = max(eps, median + 3 std)   (mode="auto")
          = max(eps, quantile)         (mode="percentile")
        scale = min(1, T / (g + eps))  once the group's gate is open, else 1
        scale = min(scale, max_grad_norm / (g + 1e-6))  where g > max_grad_norm

    The gate opens at ``max(warmup_steps, min_history)`` finite observations.
    ``feedback="observe_first"`` observes ``g`` before its own threshold; the
    others judge ``g`` first, then observe ``g`` (``"raw"``), ``min(g, T)``
    (``"clipped"``) or nothing on a clipped step (``"skip"``). A non-finite
    norm passes unchanged and is never observed. The histories and where
    this differs from smartclip: :doc:`/reference_smartclip`. A callable
    ``scope`` goes in ``static_args``.

    Static arguments: ``window_size``; every other number may be injected.

    Args:
      mode: ``"auto"`` or ``"percentile"``.
      percentile: on the 0-100 scale, in (1, 100] (percentile mode); default 95.
      history: what the statistics keep. ``mode="auto"``: ``"all"`` (P²
        median, Welford std) or ``"window"``; ``mode="percentile"``:
        ``"window"``, ``"ema"`` (a forgetting quantile) or ``"geometric"``.
        None: ``"window"``, or ``"all"`` in auto mode under ``"observe_first"``.
      window_size: length of the window (``>= 1``) of ``history="window"``;
        None (default) means 1024 in percentile mode, 100 in auto mode.
      ema_decay: decay of ``history="ema"``'s quantile, in (0, 1); default 0.99.
      scope: the groups (:class:`~clipjax.ClipTransform`), each with its statistics and gate.
      warmup_steps: finite observations before clipping may start; default
        100 under ``"observe_first"``, 10 otherwise.
      min_history: idem (default 50 under ``"observe_first"``, 10
        otherwise); the gate opens at the larger of the two.
      eps: threshold floor and denominator guard (``> 0``).
      guard_nans: keep non-finite norms out of the statistics (default);
        False is smartclip unguarded (a NaN norm enters as ``eps``).
      feedback: ``"observe_first"`` (default), ``"raw"``, ``"clipped"`` or ``"skip"``.
      quantile_lr: step size of ``history="geometric"`` (``> 0``); default 0.2.
      max_grad_norm: the ceiling (:class:`~clipjax.ClipTransform`), or None;
        ``"auto"`` (default): 1.0 under ``feedback="clipped"``, none otherwise.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``autoclip``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> clipper = clipjax.autoclip(feedback="clipped", warmup_steps=5, min_history=5)
      >>> tx, params = optax.chain(clipper, optax.sgd(0.1)), {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for x in [0.10, 0.11, 0.09, 0.10, 0.12, 0.105, 10.0]:  # a spike last
      ...     _, state = tx.update({"w": jnp.array([x, 0.0])}, state, params)
      >>> m = clipjax.metrics(state)
      >>> print(f"{m['autoclip/global/grad_norm']:.1f} {m['autoclip/global/threshold']:.3f}")
      10.0 0.133

    References:
      Seetharaman et al., `AutoClip <https://arxiv.org/abs/2007.14469>`_, 2020;
      smartclip ``AutoClip``; Andrew et al., 2021 (the geometric quantile).
    """
    s = _checked(
        mode, percentile, history, window_size, ema_decay, warmup_steps, min_history, eps,
        feedback, quantile_lr, max_grad_norm,
    )  # fmt: skip
    setup = _kit.setup(
        "autoclip", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms
    )
    reported = ("median", "std") if s.mode == "auto" else ("quantile",)
    if s.ceiling is not None:
        reported = (*reported, "headroom")

    def init_fn(params: Any) -> AutoClipState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        stats = _stats_init(s, n, dtype)
        metrics = _kit.norm_metrics(n, dtype, reported, spike=True, ceiling=s.ceiling is not None)
        state = AutoClipState(
            stats.median, stats.moments, stats.window, stats.quantile, metrics,
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: AutoClipState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AutoClipState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, AutoClipState, init_fn)
        g = grads.norm
        finite = jnp.isfinite(g)
        count = state.metrics["count"]  # the group's observations before this step
        before = _Stats(state.median, state.moments, state.window, state.quantile)

        if s.feedback == "observe_first":
            # smartclip's order: the norm enters the statistics, then its
            # threshold is read from them; the gate counts this observation.
            gate_open = count + 1 >= s.gate
            x, observed = _kit.observation(s.feedback, g, guard_nans=guard_nans)
            stats = _kit.select_groups(observed, _observe(s, before, x), before)
            values = _report(s, stats)
            threshold = _threshold(s, values)
            scale = jnp.minimum(1.0, threshold / (g + eps))
        else:
            # Judged by the statistics before the step (none yet: +inf), then observed.
            gate_open = count >= jnp.maximum(s.gate, 1)
            threshold = jnp.where(count == 0, jnp.inf, _threshold(s, _report(s, before)))
            scale = jnp.minimum(1.0, threshold / (g + eps))
            fires = (scale < 1) & gate_open & finite
            x, observed = _kit.observation(
                s.feedback, g, boundary=threshold, fires=fires, guard_nans=guard_nans
            )
            stats = _kit.select_groups(observed, _observe(s, before, x), before)
            values = _report(s, stats)
        scale = jnp.where(finite & gate_open, scale, 1.0).astype(g.dtype)
        spike = scale < 1  # the rule's own decision, before any ceiling
        capped = None
        if s.ceiling is not None:
            scale, capped = _kit.ceiling_scale(scale, g, s.ceiling)
            threshold = jnp.where(gate_open, jnp.minimum(threshold, s.ceiling), s.ceiling)
            level = values["median"] if "median" in values else values["quantile"]
            values = {**values, "headroom": _kit.headroom(s.ceiling, level)}

        metrics = _kit.step_metrics(
            state.metrics, norm=g, observed=observed, threshold=threshold, scale=scale,
            spike=spike, capped=capped, **values,
        )  # fmt: skip
        new_state = AutoClipState(
            stats.median, stats.moments, stats.window, stats.quantile, metrics,
            state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state),
        )  # fmt: skip
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as AutoClipState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
