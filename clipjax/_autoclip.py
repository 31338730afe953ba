"""autoclip: smartclip's AutoClip (P² median + Welford std, or a percentile)."""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple, cast

import jax
import jax.numpy as jnp

from clipjax import _grouping, _kit, _stats, _validation
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo
from clipjax._types import AutoClipHistory, AutoClipMode, Feedback


class AutoClipState(NamedTuple):
    """State of :func:`autoclip`: the statistics of its mode and history, then the shared fields.

    Each statistic is stacked over the groups; the fields the chosen mode and
    history do not use are None.

    Attributes:
      median: ``mode="auto"``, ``history="all"``: the P² markers of the
        median (:class:`clipjax._stats.P2State`).
      moments: ``mode="auto"``, ``history="all"``: Welford's count, mean and
        sum of squared deviations, for the std
        (:class:`clipjax._stats.WelfordState`).
      window: ``history="window"``: the last ``window_size`` observations,
        as they came and sorted (:class:`clipjax._stats.WindowState`).
      quantile: ``history="ema"``: the forgetting quantile
        (:class:`clipjax._stats.StreamingQuantileState`); ``"geometric"``:
        the geometric quantile (:class:`clipjax._stats.GeometricQuantileState`).
      metrics: this step's metrics (with ``median`` and ``std``, or
        ``quantile``, after the step) and the counters (``clipjax._kit``).
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

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
    """A ValueError for an argument the chosen mode and history never read.

    Passed at all, even at the value it would default to: the defaults are
    None, so a value was chosen by the caller.
    """
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
    _validation.choice("mode", mode, ("auto", "percentile"))
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
        _validation.choice("history", history, AUTO_HISTORIES)
        default_window = AUTO_WINDOW
    else:
        history = "window" if history is None else history
        _validation.choice("history", history, PERCENTILE_HISTORIES)
        default_window = 1024
    _no_effect(mode, history, percentile, window_size, ema_decay, quantile_lr)
    window_size = default_window if window_size is None else window_size
    percentile = 95.0 if percentile is None else percentile
    ema_decay = 0.99 if ema_decay is None else ema_decay
    quantile_lr = 0.2 if quantile_lr is None else quantile_lr
    _validation.percentile("percentile", percentile)
    _validation.integer("window_size", window_size, minimum=1)
    _validation.open_unit("ema_decay", ema_decay)
    _validation.positive("quantile_lr", quantile_lr)
    _kit.check_feedback(feedback, ("observe_first", "raw", "clipped", "skip"))
    ceiling = _kit.resolve_ceiling(max_grad_norm, feedback)
    warmup_steps, min_history = _kit.gate_defaults(feedback, warmup_steps, min_history)
    _validation.integer("warmup_steps", warmup_steps, static=False)
    _validation.integer("min_history", min_history, static=False)
    _validation.positive("eps", eps)
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


def _arrays(s: _Settings, num_groups: int, dtype: Any = jnp.float32) -> dict[str, Any]:
    """The state's own arrays: the statistics of ``s.history``, and the metrics."""
    fields: dict[str, Any] = dict.fromkeys(("median", "moments", "window", "quantile"))
    if s.history == "all":
        fields["median"] = _stats.p2_init(num_groups, 0.5, dtype)
        fields["moments"] = _stats.welford_init(num_groups, dtype)
    elif s.history == "window":
        fields["window"] = _stats.window_init(num_groups, s.window_size, dtype)
    elif s.history == "ema":
        fields["quantile"] = _stats.squantile_init(num_groups, dtype)
    else:
        fields["quantile"] = _stats.gquantile_init(num_groups, dtype)
    reported = ("median", "std") if s.mode == "auto" else ("quantile",)
    if s.ceiling is not None:
        reported = (*reported, "headroom")
    fields["metrics"] = _kit.metric_arrays(num_groups, dtype, reported, s.ceiling is not None)
    return fields


def _observe(s: _Settings, stats: dict[str, Any], x: jax.Array) -> dict[str, Any]:
    """The statistics after one observation per group, floored at ``eps``."""
    x = _stats.positive_part(x, s.eps)
    if s.history == "all":
        return {
            "median": _stats.p2_update(stats["median"], x, 0.5),
            "moments": _stats.welford_update(stats["moments"], x),
        }
    if s.history == "window":
        return {"window": _stats.window_update(stats["window"], x)}
    q, p = stats["quantile"], s.percentile / 100.0
    if s.history == "ema":
        return {"quantile": _stats.squantile_update(q, x, p, s.ema_decay)}
    return {"quantile": _stats.gquantile_update(q, x, p, s.quantile_lr)}


def _report(s: _Settings, stats: dict[str, Any]) -> dict[str, jax.Array]:
    """``median`` and ``std`` (auto), or ``quantile`` (percentile), of the statistics."""
    if s.history == "all":
        median = _stats.p2_value(stats["median"])
        return {"median": median, "std": _stats.welford_std(stats["moments"])}
    if s.mode == "auto":
        window = stats["window"]
        median = _stats.window_percentile(window, 50.0)
        return {"median": median, "std": _stats.window_mean_std(window)[1]}
    if s.history == "window":
        return {"quantile": _stats.window_percentile(stats["window"], s.percentile)}
    if s.history == "ema":
        return {"quantile": _stats.squantile_value(stats["quantile"])}
    return {"quantile": stats["quantile"].quantile}


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
    scope: Scope = "global",
    warmup_steps: int | None = None,
    min_history: int | None = None,
    eps: float = 1e-8,
    guard_nans: bool = True,
    *,
    feedback: Feedback = "observe_first",
    quantile_lr: float | None = None,
    max_grad_norm: float | Literal["auto"] | None = "auto",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """AutoClip: clip to a threshold learnt from the history of gradient norms.

    Per step and group, with ``g`` the norm (smartclip ``AutoClip``, under the
    default ``feedback="observe_first"``)::

        observe g (floored at eps: smartclip's ensure_positive), then
        T = max(eps, median + 3 std)   (mode="auto")
          = max(eps, quantile)         (mode="percentile")
        scale = min(1, T / (g + eps))  once the gate is open, else 1
        scale = min(scale, max_grad_norm / (g + 1e-6))  where g > max_grad_norm

    from statistics that include ``g``. The gate opens once the group has
    ``max(warmup_steps, min_history)`` finite observations.

    * ``mode="auto"``: ``T = median + 3 * std``. With ``history="all"`` (the
      default in this mode under ``feedback="observe_first"``, smartclip's)
      the median is P² (Jain & Chlamtac 1985) and the std Welford's (ddof=1,
      0 with one sample), both over the whole history: the large norms of
      early training keep ``T`` high long after the norm has settled, and
      after a lasting drop of the norm spikes pass at many times the new
      level. ``history="window"`` (the default under the judge-first
      feedbacks) forgets: the exact
      median and std (ddof=1) of the last ``window_size`` observations
      (default 100 in this mode), so after a lasting change of level the
      median is the new level once more than half the window holds it
      (``window_size // 2 + 1`` steps).
    * ``mode="percentile", history="window"``: ``T`` is the linearly
      interpolated ``percentile`` of the last ``window_size`` finite norms;
      equal to smartclip.
    * ``mode="percentile", history="ema"``: a scale-free stochastic-
      approximation quantile with Polyak averaging that forgets at a rate
      proportional to ``1 - ema_decay``.
    * ``mode="percentile", history="geometric"``: the geometric quantile of
      Andrew et al. (2021): start at the first norm, then
      ``q <- q * exp(-quantile_lr * (1[g <= q] - percentile / 100))``.
      Scale-free, and follows a drifting scale at a rate set by
      ``quantile_lr``.

    ``feedback`` says what a step teaches the statistics:

    * ``"observe_first"`` (default, smartclip's order): the norm is observed
      before its own threshold is computed, so a large spike raises its own
      threshold (with a few hundred norms of history a x1000 spike still
      passes at a large fraction of its size in auto mode). Use it to
      reproduce smartclip.
    * ``"raw"``: the threshold comes from the statistics *before* the step;
      then the norm is observed. The gate then opens once
      ``max(warmup_steps, min_history, 1)`` norms were observed before the
      step. Before a group's first finite norm the threshold reads ``+inf``.
    * ``"clipped"``: judged first as ``"raw"``; every step is observed as
      ``min(g, T)``, so a spike cannot raise the threshold by more than a norm
      at the threshold would, while a lasting rise of the norm is learnt. With
      the window history (its default) this setting stops spikes and follows a
      training run. In percentile mode the norm itself is
      observed (a quantile is a rank statistic: a spike moves it by one rank
      at most, while feeding it ``T`` would only drag it down).
    * ``"skip"``: judged first; a clipped step is not observed at all (its
      ``count`` does not advance). A lasting upward shift of the norm can hold
      the threshold at the old level. Not available in percentile mode
      (``ValueError``): a p-quantile fires on ``1 - p`` of the steps by design,
      and never observing them drags it down without bound.

    While the gate is closed every finite norm is observed as it is. Left as
    None, ``warmup_steps`` and ``min_history`` are smartclip's 100 and 50 under
    ``"observe_first"``, and 10 each under the judge-first settings: a clipper
    that judges a step before observing it, and feeds back the clipped norm,
    needs few observations, and a long gate lets the large norms of early
    training through and into the statistics. A non-finite norm passes
    unchanged and never enters the statistics (``guard_nans``).

    Unlike smartclip:

    * P²'s parabolic step uses the textbook formula; smartclip omits the
      ``1 / (n[i+1] - n[i-1])`` factor.
    * Before 5 observations smartclip's median is undefined and ``T = eps``;
      here it is the exact median of the observations so far.
    * smartclip's EMA quantile ``q += a (x - q)(p - 1[x < q])`` can never
      decrease; the estimator here converges to the true quantile and follows
      the stream down as well as up.
    * Each group counts its own finite observations for the gate (smartclip
      counts one per group per call, ending per-layer warm-up early), and a
      non-finite norm never enters the statistics.

    An argument the chosen mode and history never read (``percentile`` in
    auto mode; ``window_size``, ``ema_decay``, ``quantile_lr`` outside their
    history) raises a ``ValueError``, even when passed at its default value.

    Static arguments: ``window_size`` (it sizes the window); every other number
    may be injected or scheduled with ``optax.inject_hyperparams``, with no
    ``static_args``; a callable ``scope`` goes in ``static_args``
    (inject_hyperparams would call it as a schedule).

    Args:
      mode: ``"auto"`` or ``"percentile"``.
      percentile: the percentile, on the 0-100 scale, in (1, 100]
        (``mode="percentile"`` only); default 95. A value in (0, 1], almost
        surely a fraction (0.95 for 95), raises a ``ValueError``.
      history: ``mode="auto"``: ``"all"`` or ``"window"``; None (default)
        means ``"all"`` under ``feedback="observe_first"`` (smartclip's) and
        ``"window"`` otherwise. ``mode="percentile"``: ``"window"`` (None
        means this), ``"ema"`` or ``"geometric"``.
      window_size: length of the window (``>= 1``) of ``history="window"``;
        None (default) means 1024 in percentile mode, 100 in auto mode.
      ema_decay: decay of the streaming quantile of ``history="ema"``, in
        (0, 1); default 0.99.
      scope: ``"global"``, ``"per_param"``, ``"per_layer"``, a callable or
        :func:`clipjax.stacked`; each group has its own statistics and gate.
      warmup_steps: finite observations before clipping may start; default
        100 under ``"observe_first"``, 10 otherwise.
      min_history: idem (default 50 under ``"observe_first"``, 10
        otherwise); the gate opens at the larger of the two.
      eps: threshold floor and denominator guard (``> 0``).
      guard_nans: keep non-finite norms out of the statistics (default);
        False reproduces smartclip unguarded: a NaN norm enters as ``eps``, an
        infinite one as it is.
      feedback: ``"observe_first"`` (default), ``"raw"``, ``"clipped"`` or
        ``"skip"``, see above.
      quantile_lr: step size of the geometric quantile (``> 0``;
        ``history="geometric"`` only); default 0.2.
      max_grad_norm: the ceiling: an absolute bound on every step's norm,
        applied from the first step (also while the gate is closed); None for
        none. ``"auto"`` (default): 1.0 under ``feedback="clipped"`` (a
        spike defence bounds the first steps of a run, whose norms no
        statistic has seen yet), none otherwise (the reference has none). It
        assumes a healthy step's norm is below 1; where ``capped`` shows most
        steps capped after the first few hundred, raise it.
      axis_name: average the group norms over this mapped axis first, so every
        replica keeps identical statistics and applies the same scale.
      leaf_norms: also record each leaf's L2 norm before clipping, as
        ``autoclip/leaf/{leaf path}/grad_norm``.
      name: metrics prefix (default ``autoclip``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose state is an
      :class:`AutoClipState`; metrics per group: ``grad_norm``, ``threshold``
      (at most the ceiling; the ceiling while the gate is closed), ``scale``,
      ``clipped``, ``capped`` (with a ceiling: it was the bound), the
      counters, and ``median``, ``std`` (auto) or ``quantile`` (percentile)
      after the step.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> # feedback="clipped" stops spikes; the short warm-up keeps the example short.
      >>> clipper = clipjax.autoclip(feedback="clipped", warmup_steps=5, min_history=5)
      >>> tx = optax.chain(clipper, optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for x in [0.10, 0.11, 0.09, 0.10, 0.12, 0.105, 10.0]:  # a spike last
      ...     _, state = tx.update({"w": jnp.array([x, 0.0])}, state, params)
      >>> m = clipjax.metrics(state)
      >>> print(f"{m['autoclip/global/grad_norm']:.1f} {m['autoclip/global/threshold']:.3f}")
      10.0 0.133
      >>> bool(m["autoclip/global/clipped"]), bool(m["autoclip/global/capped"])  # a spike clip
      (True, False)

    References:
      Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source
      Separation Networks <https://arxiv.org/abs/2007.14469>`_, 2020;
      smartclip ``AutoClip`` (PyPI ``smartclip``); Andrew et al.,
      `Differentially Private Learning with Adaptive Clipping
      <https://arxiv.org/abs/1905.03871>`_, 2021 (geometric quantile).
    """
    settings = dict(locals())
    s = _checked(
        mode, percentile, history, window_size, ema_decay, warmup_steps, min_history, eps,
        feedback, quantile_lr, max_grad_norm,
    )  # fmt: skip
    _kit.check_name(name)
    _grouping.validate_scope(scope)
    own = {"all": ("median", "moments"), "window": ("window",)}.get(s.history, ("quantile",))
    layout = _kit.layout_of(functools.partial(_arrays, s))

    def init_fn(params: Any) -> Any:
        start = _kit.start(params, scope, "autoclip", name, leaf_norms)
        return _kit.new_state(AutoClipState, start, _arrays(s, start.num_groups, start.dtype))

    def update_fn(
        updates: Any, state: AutoClipState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AutoClipState]:
        del params, extra_args
        grads = _kit.group_norms(
            updates, state, AutoClipState, layout, who=name or "autoclip", scope=scope,
            axis_name=axis_name, leaf_norms=leaf_norms,
        )  # fmt: skip
        g = grads.norm
        finite = jnp.isfinite(g)
        count = state.metrics["count"]  # the group's observations before this step
        before = {field: getattr(state, field) for field in own}

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
        capped = None
        if s.ceiling is not None:
            scale, capped = _kit.ceiling_scale(scale, g, s.ceiling)
            threshold = jnp.where(gate_open, jnp.minimum(threshold, s.ceiling), s.ceiling)
            level = values["median"] if "median" in values else values["quantile"]
            values = {**values, "headroom": _kit.headroom(s.ceiling, level)}

        metrics = _kit.step_metrics(
            state.metrics, norm=g, threshold=threshold, scale=scale, observed=observed,
            capped=capped, **values,
        )  # fmt: skip
        new_state = state._replace(**stats, **_kit.shared_fields(state, grads, metrics))
        return _kit.scaled(grads, scale, state), new_state

    # optax types a state as OptState (an array tree), not as AutoClipState.
    tx = ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
    tx.configure = lambda **overrides: autoclip(**{**settings, **overrides})
    return tx
