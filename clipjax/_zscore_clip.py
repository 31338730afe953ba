"""zscore_clip: smartclip's ZScoreClip, observe then clip."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from clipjax import _engine, _stats, _validation
from clipjax._engine import Decision, NormRule

ZScoreClipState = _engine.register_algo(
    "zscore_clip", "State of :func:`zscore_clip`: EMA moments per group.", "ZScoreClipState"
)


def zscore_clip(
    zmax: float = 3.0,
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
    """Clip norms more than ``zmax`` EMA standard deviations above the EMA mean.

    Per step and group (smartclip ``ZScoreClip``): observe the finite norm
    into EMAs of ``x`` and ``x**2`` (both starting at the first value, no bias
    correction), then ``std = sqrt(max(0, m2 - m**2))``,
    ``T = max(eps, m + zmax * std)`` and ``scale = min(1, T / (g + eps))``
    once the group has ``max(warmup_steps, min_history)`` finite observations.

    Observe-then-clip: the current norm enters the statistics before its own
    threshold is computed, so a large spike raises its own threshold (with a
    long history a x1000 spike still passes at a fraction of its size). This
    is smartclip's behaviour; :func:`zclip` and :func:`hist_clip` judge a norm
    by the statistics before it.

    The variance uses the recursion ``S <- d S + d (1 - d) (x - m_old)**2``,
    equal to ``m2 - m**2`` in exact arithmetic but free of float32
    cancellation (SPEC 8.14).

    **FIX**: smartclip counts one observation per group per call towards its
    single gate, so per-layer warm-up ends N times too early; here each group
    counts its own finite observations. A non-finite norm never enters the
    statistics (smartclip multiplies the gradient by NaN or 0).

    Args:
      zmax: z-score above which norms are clipped (``> 0``).
      ema_decay: decay of the EMAs, in (0, 1).
      scope: ``"global"``, ``"per_param"``, ``"per_layer"`` or a callable.
      warmup_steps: finite observations before clipping may start.
      min_history: idem; the gate opens at the larger of the two.
      eps: threshold floor and denominator guard (``> 0``).
      guard_nans: keep non-finite norms out of the statistics (default).
      axis_name: average group norms over this mapped axis (SPEC 5).
      name: metrics prefix (default ``zscore_clip``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; metrics per group:
      ``grad_norm``, ``threshold``, ``scale``, ``clipped``, ``mean``, ``std``
      and the counters.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.zscore_clip(warmup_steps=3, min_history=3)
      >>> g = lambda x: {"w": jnp.array([x])}
      >>> state = tx.init(g(0.0))
      >>> for x in [1.0, 1.2, 0.8, 1.1, 30.0]:
      ...     out, state = tx.update(g(x), state)
      >>> float(out["w"][0]) < 30.0
      True

    References:
      smartclip ``ZScoreClip`` (PyPI ``smartclip``).
    """
    _validation.positive("zmax", zmax)
    _validation.open_unit("ema_decay", ema_decay)
    _validation.integer("warmup_steps", warmup_steps, static=False)
    _validation.integer("min_history", min_history, static=False)
    _validation.positive("eps", eps)

    def init(num_groups: int, dtype: Any) -> Any:
        return _stats.ema_moments_init(num_groups, dtype)

    def observe(stats: Any, g: jax.Array, count: jax.Array) -> Any:
        return _stats.ema_moments_update(stats, _engine.smartclip_observation(g, eps), ema_decay)

    def threshold_of(stats: Any) -> jax.Array:
        return jnp.maximum(eps, stats.mean + zmax * _stats.ema_moments_std(stats))

    def decide(before: Any, after: Any, g: jax.Array, count: jax.Array, aux: Any) -> Decision:
        threshold = threshold_of(after)
        gate = jnp.maximum(warmup_steps, min_history)
        return _engine.observe_then_clip(threshold, g, count, eps, gate)

    def report(stats: Any) -> dict[str, jax.Array]:
        return {"mean": stats.mean, "std": _stats.ema_moments_std(stats)}

    rule = NormRule("zscore_clip", decide, init=init, observe=observe, report=report)
    return _engine.norm_transform(
        rule, scope=scope, name=name, axis_name=axis_name, guard_nans=guard_nans
    )
