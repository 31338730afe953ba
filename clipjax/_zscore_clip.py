"""zscore_clip: smartclip's ZScoreClip, observe then clip."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _engine, _stats, _validation
from clipjax._autoclip import gate_defaults
from clipjax._engine import Judgement, NormRule
from clipjax._grouping import Scope
from clipjax._metrics import GroupInfo
from clipjax._types import Feedback

# The EMAs' decay under judge-first feedback: smartclip's 0.99 remembers a
# level for hundreds of steps, so after a lasting drop of the norm its std stays
# wide and spikes pass at several times the new level; 0.97 forgets within
# about a hundred (measured by benchmarks/follow.py).
JUDGE_FIRST_DECAY = 0.97


class ZScoreClipState(NamedTuple):
    """State of :func:`zscore_clip`.

    Attributes:
      stats: EMA moments per group (mean, variance, observation count).
      metrics: ``{field: [groups] array}``, read by :func:`clipjax.metrics`.
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.zscore_clip().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ZScoreClipState), state.info.groups
      (True, ('global',))
    """

    stats: Any
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


def zscore_clip(
    zmax: float = 3.0,
    ema_decay: float | None = None,
    scope: Scope = "global",
    warmup_steps: int | None = None,
    min_history: int | None = None,
    eps: float = 1e-8,
    guard_nans: bool = True,
    *,
    feedback: Feedback = "observe_first",
    max_grad_norm: float | Literal["auto"] | None = "auto",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> _engine.ClipTransform:
    """Clip norms more than ``zmax`` EMA standard deviations above the EMA mean.

    Per step and group (smartclip ``ZScoreClip``): observe the finite norm
    into EMAs of ``x`` and ``x**2`` (both starting at the first value, no bias
    correction), then ``std = sqrt(max(0, m2 - m**2))``,
    ``T = max(eps, m + zmax * std)`` and ``scale = min(1, T / (g + eps))``
    once the group has ``max(warmup_steps, min_history)`` finite observations.

    ``feedback="observe_first"`` (the default, smartclip's order): the current
    norm enters the statistics before its own threshold is computed, so a
    large spike raises its own threshold (with a long history a x1000 spike
    still passes at a fraction of its size). The other settings judge the
    step by the statistics from *before* it (the gate then opens once
    ``max(warmup_steps, min_history, 1)`` norms were observed before the
    step) and then observe: the norm (``"raw"``), ``min(g, T)`` (``"clipped"``,
    the setting that stops spikes and, with its default decay, follows a
    training run), or
    nothing on a clipped step, whose ``count`` does not advance (``"skip"``;
    a lasting upward shift of the norm can then hold the threshold at the old
    level). Under those, before a group's first finite norm the threshold
    reads ``+inf``. While the gate is closed every finite norm is observed as
    it is. Left as None, ``warmup_steps`` and ``min_history`` are smartclip's
    100 and 50 under ``"observe_first"`` and 10 each under the judge-first
    settings (a long gate lets the large norms of early training into the
    statistics; judged first, few observations are enough).

    The variance uses the recursion ``S <- d S + d (1 - d) (x - m_old)**2``,
    equal to ``m2 - m**2`` in exact arithmetic but free of float32
    cancellation.

    **FIX**: smartclip counts one observation per group per call towards its
    single gate, so per-layer warm-up ends N times too early; here each group
    counts its own finite observations. A non-finite norm never enters the
    statistics (smartclip multiplies the gradient by NaN or 0).

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args``; a callable ``scope``
    goes in ``static_args`` (inject_hyperparams would call it as a schedule).

    Args:
      zmax: z-score above which norms are clipped (``> 0``).
      ema_decay: decay of the EMAs, in (0, 1). None (default) means
        smartclip's 0.99 under ``"observe_first"`` and 0.97 under the
        judge-first settings (forgets a lasting change of level within a few
        hundred steps, so spikes after a drop of the norm are still caught).
      scope: ``"global"``, ``"per_param"``, ``"per_layer"`` or a callable.
      warmup_steps: finite observations before clipping may start; default
        100 under ``"observe_first"``, 10 otherwise.
      min_history: idem (default 50 under ``"observe_first"``, 10
        otherwise); the gate opens at the larger of the two.
      eps: threshold floor and denominator guard (``> 0``).
      guard_nans: keep non-finite norms out of the statistics (default).
      feedback: ``"observe_first"`` (default), ``"raw"``, ``"clipped"`` or
        ``"skip"``, see above.
      max_grad_norm: the ceiling: an absolute bound on every step's norm,
        applied from the first step (also while the gate is closed); None for
        none. ``"auto"`` (default): 1.0 under ``feedback="clipped"`` (a
        spike defence bounds the first steps of a run, whose norms no
        statistic has seen yet), none otherwise (the reference has none). It
        assumes a healthy step's norm is below 1; where ``capped`` shows most
        steps capped after the first few hundred, raise it.
      axis_name: average the group norms over this mapped axis first, so every
        replica keeps identical statistics and applies the same scale.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``zscore_clip``).

    Returns:
      A :class:`~clipjax.ClipTransform`; metrics per group:
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
    _engine.check_feedback(feedback, ("observe_first", "raw", "clipped", "skip"))
    ceiling = _engine.resolve_ceiling(max_grad_norm, feedback)
    if ema_decay is None:
        ema_decay = 0.99 if feedback == "observe_first" else JUDGE_FIRST_DECAY
    _validation.open_unit("ema_decay", ema_decay)
    warmup_steps, min_history = gate_defaults(feedback, warmup_steps, min_history)
    _validation.integer("warmup_steps", warmup_steps, static=False)
    _validation.integer("min_history", min_history, static=False)
    _validation.positive("eps", eps)
    judge_first = feedback != "observe_first"
    statistic = _stats.EmaMeanStd(eps, ema_decay)

    def judge(stats: Any, g: jax.Array, count: jax.Array, aux: Any) -> Judgement:
        values = statistic.report(stats)
        threshold = jnp.maximum(eps, values["mean"] + zmax * values["std"])
        if judge_first:
            # No statistics yet: nothing to judge by.
            threshold = jnp.where(count == 0, jnp.inf, threshold)
        return Judgement(threshold, jnp.minimum(1.0, threshold / (g + eps)))

    rule = NormRule(
        "zscore_clip",
        judge,
        statistic,
        feedback=feedback,
        gate=jnp.maximum(warmup_steps, min_history),
        ceiling=ceiling,
    )
    return _engine.transform(
        rule,
        ZScoreClipState,
        scope=scope,
        name=name,
        axis_name=axis_name,
        guard_nans=guard_nans,
        leaf_norms=leaf_norms,
    )
