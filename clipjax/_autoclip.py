"""autoclip: smartclip's AutoClip (P² median + Welford std, or a percentile)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _engine, _stats, _validation
from clipjax._engine import Decision, NormRule

AutoClipState = _engine.register_algo(
    "autoclip", "State of :func:`autoclip`: the statistics of its mode.", "AutoClipState"
)


class AutoStats(NamedTuple):
    """Statistics of ``autoclip(mode="auto")``.

    Attributes:
      median: P² median markers.
      moments: Welford count, mean and sum of squared deviations.
    """

    median: Any
    moments: Any


def autoclip(
    mode: str = "auto",
    percentile: float = 95.0,
    history: str = "window",
    window_size: int = 1024,
    ema_decay: float = 0.99,
    scope: Any = "global",
    warmup_steps: int = 100,
    min_history: int = 50,
    eps: float = 1e-8,
    guard_nans: bool = True,
    *,
    axis_name: str | None = None,
    name: str | None = None,
) -> _engine.ClipTransform:
    """AutoClip: clip to a threshold learnt from the history of gradient norms.

    Per step and group (smartclip ``AutoClip``): observe the finite norm, then
    compute the threshold ``T`` from statistics that include it, then scale by
    ``min(1, T / (g + eps))`` once the group has ``max(warmup_steps,
    min_history)`` finite observations. ``T`` is floored at ``eps``.

    * ``mode="auto"``: ``T = median + 3 * std`` with the P² median (Jain &
      Chlamtac 1985) and Welford's std (ddof=1, 0 with one sample) over the
      whole history.
    * ``mode="percentile", history="window"``: ``T`` is the linearly
      interpolated ``percentile`` of the last ``window_size`` finite norms;
      equal to smartclip.
    * ``mode="percentile", history="ema"``: a streaming quantile estimator
      with forgetting rate ``1 - ema_decay`` (see
      :func:`clipjax._stats.squantile_update`).

    Observe-then-clip: a large spike enters the statistics before its own
    threshold is computed and so raises it (with 200 samples of history a
    x1000 spike still passes at about a fifth of its size in auto mode). This
    is smartclip's behaviour and the default; the window percentile mode,
    :func:`zclip` and :func:`hist_clip` do stop such spikes.

    **FIX** (differences from smartclip):

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

    Args:
      mode: ``"auto"`` or ``"percentile"``.
      percentile: the percentile in (0, 100] for ``mode="percentile"``.
      history: ``"window"`` or ``"ema"`` for ``mode="percentile"``.
      window_size: length of the window (``>= 1``).
      ema_decay: decay of the streaming quantile, in (0, 1).
      scope: ``"global"``, ``"per_param"``, ``"per_layer"`` or a callable.
      warmup_steps: finite observations before clipping may start.
      min_history: idem; the gate opens at the larger of the two.
      eps: threshold floor and denominator guard (``> 0``).
      guard_nans: keep non-finite norms out of the statistics (default).
      axis_name: average group norms over this mapped axis (SPEC 5).
      name: metrics prefix (default ``autoclip``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; metrics per group:
      ``grad_norm``, ``threshold``, ``scale``, ``clipped``, the counters, and
      ``median``, ``std`` (auto) or ``quantile`` (percentile).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = optax.chain(clipjax.autoclip(warmup_steps=5, min_history=5), optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for x in [1.0, 1.1, 0.9, 1.0, 1.2, 1.05]:
      ...     _, state = tx.update({"w": jnp.array([x, 0.0])}, state, params)
      >>> sorted(k for k in clipjax.metrics(state) if "/global/" in k)[:3]
      ['autoclip/global/clipped', 'autoclip/global/clipped_count', 'autoclip/global/count']

    References:
      Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source
      Separation Networks <https://arxiv.org/abs/2007.14469>`_, 2020;
      smartclip ``AutoClip`` (PyPI ``smartclip``).
    """
    _validation.choice("mode", mode, ("auto", "percentile"))
    _validation.choice("history", history, ("window", "ema"))
    _validation.check("percentile", percentile, lambda x: 0 < x <= 100, "in (0, 100]")
    _validation.integer("window_size", window_size, minimum=1)
    _validation.open_unit("ema_decay", ema_decay)
    _validation.integer("warmup_steps", warmup_steps, static=False)
    _validation.integer("min_history", min_history, static=False)
    _validation.positive("eps", eps)
    kind = "auto" if mode == "auto" else history

    def init(num_groups: int, dtype: Any) -> Any:
        if kind == "auto":
            return AutoStats(
                _stats.p2_init(num_groups, 0.5, dtype), _stats.welford_init(num_groups, dtype)
            )
        if kind == "window":
            return _stats.window_init(num_groups, window_size, dtype)
        return _stats.squantile_init(num_groups, dtype)

    def observe(stats: Any, g: jax.Array, count: jax.Array) -> Any:
        x = _engine.smartclip_observation(g, eps)
        if kind == "auto":
            return AutoStats(
                _stats.p2_update(stats.median, x, 0.5), _stats.welford_update(stats.moments, x)
            )
        if kind == "window":
            return _stats.window_update(stats, x)
        return _stats.squantile_update(stats, x, percentile / 100.0, ema_decay)

    def report(stats: Any) -> dict[str, jax.Array]:
        if kind == "auto":
            return {
                "median": _stats.p2_value(stats.median),
                "std": _stats.welford_std(stats.moments),
            }
        if kind == "window":
            return {"quantile": _stats.window_percentile(stats, percentile)}
        return {"quantile": _stats.squantile_value(stats)}

    def threshold_of(stats: Any) -> jax.Array:
        values = report(stats)
        if kind == "auto":
            raw = values["median"] + 3.0 * values["std"]
        else:
            raw = values["quantile"]
        return jnp.maximum(raw, eps)

    def decide(before: Any, after: Any, g: jax.Array, count: jax.Array, aux: Any) -> Decision:
        threshold = threshold_of(after)
        gate = jnp.maximum(warmup_steps, min_history)
        return _engine.observe_then_clip(threshold, g, count, eps, gate)

    rule = NormRule("autoclip", decide, init=init, observe=observe, report=report)
    return _engine.norm_transform(
        rule, scope=scope, name=name, axis_name=axis_name, guard_nans=guard_nans
    )
