"""hist_clip: drytorch's HistClipper / ParamHistClipper, clip then observe."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _engine, _static, _stats, _validation
from clipjax._engine import Judgement, NormRule
from clipjax._grouping import Scope
from clipjax._metrics import GroupInfo
from clipjax._types import TargetFeedback


class HistClipState(NamedTuple):
    """State of :func:`hist_clip`.

    Attributes:
      stats: the criterion's running mean (and variance) per group, and the
        warm-up sample's running sums (count, total, sum of squared
        deviations; ``[groups]`` each, whatever ``warmup_steps``).
      metrics: ``{field: [groups] array}``, read by :func:`clipjax.metrics`.
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.
      nested: the ``warmup_clip`` state (None without one); its metrics are
        reported under ``hist_clip/...``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.hist_clip().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.HistClipState), state.info.groups
      (True, ('global',))
    """

    stats: Any
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]
    nested: Any = None


# drytorch's guards: the z-statistic's denominator and clip_grad_norm_'s.
_Z_EPS = 1e-8
_DIV_EPS = 1e-6

ClipFunction = Callable[[jax.Array, Any], jax.Array]


def max_clipping(zt: jax.Array, thresh: Any) -> jax.Array:
    """Clip to the threshold itself: factor ``thresh`` (drytorch ``max_clipping``).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> float(clipjax.max_clipping(jnp.array(4.0), 2.5))
      2.5
    """
    return jnp.full_like(zt, thresh)


def mean_clipping(zt: jax.Array, thresh: Any) -> jax.Array:
    """Clip to the running mean (drytorch ``mean_clipping``).

    With :func:`zstat_criterion` the factor is 0 (clip value ``mu``). With
    :func:`ema_criterion` the factor is 1, i.e. the clip value is ``mu`` too:
    **FIX**, drytorch returns 0 there, which makes the clip value 0 and zeroes
    the gradient, contrary to its own documentation ("clip to the mean").

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> float(clipjax.mean_clipping(jnp.array(4.0), 2.5))
      0.0
    """
    return jnp.zeros_like(zt)


def reciprocal_clipping(zt: jax.Array, thresh: Any) -> jax.Array:
    """Reciprocal clipping, ``thresh**2 / zt``: larger spikes are cut harder (ZClip).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> float(clipjax.reciprocal_clipping(jnp.array(5.0), 2.5))
      1.25
    """
    return thresh**2 / zt


def _zstat_score(g: jax.Array, mu: jax.Array, var: jax.Array) -> jax.Array:
    return jnp.abs((g - mu) / (jnp.sqrt(var) + _Z_EPS))


def _zstat_clip_value(factor: jax.Array, mu: jax.Array, var: jax.Array) -> jax.Array:
    return mu + factor * jnp.sqrt(var)


def _zstat_boundary(mu: jax.Array, var: jax.Array, thresh: Any) -> jax.Array:
    # The norm at which |z| reaches thresh on the high side.
    return mu + thresh * (jnp.sqrt(var) + _Z_EPS)


def _ratio_score(g: jax.Array, mu: jax.Array, var: jax.Array) -> jax.Array:
    return g / jnp.where(mu != 0, mu, 1.0)


def _ratio_clip_value(factor: jax.Array, mu: jax.Array, var: jax.Array) -> jax.Array:
    return mu * factor


def _ratio_boundary(mu: jax.Array, var: jax.Array, thresh: Any) -> jax.Array:
    return mu * thresh


@dataclasses.dataclass(frozen=True)
class Criterion:
    """A hist_clip criterion: which statistic fires, and how far it clips.

    Attributes:
      kind: ``"zstat"`` or ``"ema"`` (a label; the behaviour is in the fields
        below).
      alpha: EMA decay of the statistics.
      thresh: ``z_thresh`` (zstat) or ``r_thresh`` (ema).
      clip_fn: ``(statistic, thresh) -> factor``.
      variance: how the running variance updates: ``"before_mean"`` (with
        the mean from before the step) or None (no variance is kept).
      score: ``(g, mu, var) -> statistic`` compared with ``thresh``.
      clip_value: ``(factor, mu, var) -> clip value``.
      boundary: ``(mu, var, thresh) -> norm`` above which the criterion fires
        on the high side (the spike boundary).
      mean_factor: the factor :func:`mean_clipping` stands for (the one that
        makes the clip value ``mu``).
      score_name: the metric that reports the statistic, or None.

    Examples:
      >>> import clipjax
      >>> criterion = clipjax.zstat_criterion(z_thresh=3.0)
      >>> isinstance(criterion, clipjax.Criterion), criterion.kind, criterion.thresh
      (True, 'zstat', 3.0)
    """

    kind: str
    alpha: Any
    thresh: Any
    clip_fn: ClipFunction
    variance: str | None
    score: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
    clip_value: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
    boundary: Callable[[jax.Array, jax.Array, Any], jax.Array]
    mean_factor: float
    score_name: str | None


def _check_clip_fn(clip_fn: Any) -> None:
    if not callable(clip_fn):
        raise ValueError(f"clip_fn must be callable, got {clip_fn!r}")


def zstat_criterion(
    alpha: float = 0.97, z_thresh: float = 2.5, clip_fn: ClipFunction = reciprocal_clipping
) -> Criterion:
    """drytorch ``ZStatCriterion``: fire when ``|z| > z_thresh``.

    ``z = (g - mu) / (sqrt(v) + 1e-8)``; clip value ``mu + clip_fn(|z|,
    z_thresh) * sqrt(v)``; update with the raw norm:
    ``v <- alpha v + (1-alpha)(g - mu_old)**2`` then
    ``mu <- alpha mu + (1-alpha) g``.

    Examples:
      >>> import clipjax
      >>> tx = clipjax.hist_clip(clipjax.zstat_criterion(alpha=0.9, z_thresh=3.0))
    """
    _validation.open_unit("alpha", alpha)
    _validation.positive("z_thresh", z_thresh)
    _check_clip_fn(clip_fn)
    return Criterion(
        "zstat",
        alpha,
        z_thresh,
        clip_fn,
        variance="before_mean",
        score=_zstat_score,
        clip_value=_zstat_clip_value,
        boundary=_zstat_boundary,
        mean_factor=0.0,
        score_name="z",
    )


def ema_criterion(
    alpha: float = 0.98, r_thresh: float = 1.05, clip_fn: ClipFunction = max_clipping
) -> Criterion:
    """drytorch ``EMACriterion``: fire when ``r = g / mu > r_thresh``.

    Clip value ``mu * clip_fn(r, r_thresh)`` (``mu`` for :func:`mean_clipping`,
    a **FIX**); update ``mu <- alpha mu + (1-alpha) g``.

    Examples:
      >>> import clipjax
      >>> tx = clipjax.hist_clip(clipjax.ema_criterion(r_thresh=1.1, clip_fn=clipjax.mean_clipping))
    """
    _validation.open_unit("alpha", alpha)
    _validation.positive("r_thresh", r_thresh)
    _check_clip_fn(clip_fn)
    # mean_factor 1: clip to the running mean (drytorch's 0 zeroes the gradient).
    return Criterion(
        "ema",
        alpha,
        r_thresh,
        clip_fn,
        variance=None,
        score=_ratio_score,
        clip_value=_ratio_clip_value,
        boundary=_ratio_boundary,
        mean_factor=1.0,
        score_name=None,
    )


def hist_clip(
    criterion: Criterion | None = None,
    warmup_steps: int = 20,
    warmup_clip: optax.GradientTransformation | str | None = "default",
    scope: Scope = "global",
    *,
    feedback: TargetFeedback = "raw",
    max_grad_norm: float | Literal["auto"] | None = "auto",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> _engine.ClipTransform:
    """Clip by a criterion on the history of gradient norms (drytorch HistClipper).

    Warm-up: the first ``warmup_steps`` finite norms of a group are collected
    while ``warmup_clip`` is applied (default ``clip_by_global_norm(1.0)``,
    None for none). On the next step the criterion starts from their mean and
    ddof=1 variance (kept at 1.0 unless positive), and that step is already
    judged by the criterion. Then, with statistics from *before* the step
    (clip, then observe): when the criterion fires the gradient is scaled by
    ``min(1, clip / (g + 1e-6))``; the statistics absorb the raw norm. No
    clipping while ``mu == 0``.

    ``feedback`` says what a step teaches the statistics, with ``B`` the
    spike boundary before the step (``mu + z_thresh * sqrt(v)`` for zstat,
    ``mu * r_thresh`` for ema):

    * ``"raw"`` (default, drytorch's rule): the norm itself; a spike inflates
      the statistics.
    * ``"clipped"``: ``min(g, B)`` on every step: a spike teaches no more
      than a norm at the boundary would, and a lasting rise of the norm is
      learnt (each step at the boundary widens it): it stops spikes and
      follows a training run.
    * ``"clip_target"``: on a high-side fire, the criterion's clip value.
      With :func:`reciprocal_clipping` or :func:`mean_clipping` that value
      lies below ``B`` and tends to ``mu`` as the spike grows, so the
      statistics cannot rise past a lasting upward shift: the std collapses
      and **every later step is clipped to the old mean** (measured by
      ``python benchmarks/follow.py``: after a x2 shift with 5% noise, 100%
      of the later steps are clipped).
    * ``"skip"``: nothing on a high-side fire (the group's ``count`` does not
      advance); a lasting upward shift of the norm can hold the statistics at
      the old level.

    Warm-up norms are always collected as they are.

    ``scope="per_param"`` is drytorch's ParamHistClipper: statistics, warm-up
    and the warm-up clip per leaf. A clipjax ``warmup_clip`` is rebuilt for
    hist_clip's groups (and ``axis_name``), so it clips each warming group by
    its own norm; any other optax transform is applied to the whole tree.
    Either runs only while some group warms up (under ``lax.cond``); a
    ``warmup_clip`` given with ``warmup_steps=0`` (no warm-up) raises a
    ``ValueError``. Once a
    group's warm-up is over, the warm-up clip's nested metrics for it read as
    at init (``grad_norm`` 0, ``scale`` 1, ``clipped`` False) and its counters
    keep their totals: they never report a stale decision.

    **FIX**: drytorch's EMA criterion with ``mean_clipping`` zeroes the
    gradient; here it clips to the running mean. A NaN/Inf norm poisons
    drytorch's statistics; here it is kept out of them (and out of the
    warm-up clip's state) and the gradient passes unchanged.

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args`` (``warmup_steps`` too:
    the warm-up sample is kept as running sums; the criterion's numbers through
    a factory that builds it); a callable ``scope`` goes in ``static_args``
    (inject_hyperparams would call it as a schedule).

    Args:
      criterion: :func:`zstat_criterion` (default) or :func:`ema_criterion`.
      warmup_steps: number of finite norms collected before the criterion.
      warmup_clip: transform applied during warm-up, or None; ``"default"``
        (default) means ``clip_by_global_norm(1.0)``.
      scope: ``"global"``, ``"per_param"``, ``"per_layer"`` or a callable.
      feedback: ``"raw"`` (default), ``"clipped"``, ``"clip_target"`` or
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
      name: metrics prefix (default ``hist_clip``).

    Returns:
      A :class:`~clipjax.ClipTransform`. Metrics per group:
      ``grad_norm``, ``threshold`` (the boundary ``B`` above which the step is
      clipped; +inf during warm-up and while ``mu == 0``), ``clip_to`` (the
      norm the step leaves with: the clip value on a clipped step, the norm
      itself otherwise), ``scale`` (1 during warm-up; the warm-up clip reports
      its own metrics under ``hist_clip/<its name>/...``), ``clipped``,
      ``mean``, ``std`` and ``z`` (zstat), and the counters.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.hist_clip(warmup_steps=3)
      >>> g = lambda x: {"w": jnp.array([x])}
      >>> state = tx.init(g(0.0))
      >>> for x in [0.5, 0.6, 0.55, 0.5, 9.0]:
      ...     out, state = tx.update(g(x), state)
      >>> round(float(out["w"][0]), 3) < 9.0
      True

    References:
      drytorch ``drytorch.lib.gradient_ops.HistClipper``; Kumar et al.,
      `ZClip <https://arxiv.org/abs/2504.02507>`_ (reciprocal clipping), 2025.
    """
    criterion = zstat_criterion() if criterion is None else criterion
    if not isinstance(criterion, Criterion):
        raise ValueError(
            "criterion must come from clipjax.zstat_criterion() or clipjax.ema_criterion(), "
            f"got {criterion!r}"
        )
    _validation.integer("warmup_steps", warmup_steps, minimum=0, static=False)
    if _validation.concrete(warmup_steps) == 0 and not (
        warmup_clip is None or isinstance(warmup_clip, str)
    ):
        raise ValueError(
            f"warmup_clip={warmup_clip!r} has no effect with warmup_steps=0 (there is no "
            "warm-up to clip): leave warmup_clip out, or give warmup_steps > 0"
        )
    if isinstance(warmup_clip, str):
        if warmup_clip != "default":
            raise ValueError(
                f"warmup_clip must be a GradientTransformation or None, got {warmup_clip!r}"
            )
        warmup_clip = _static.clip_by_global_norm(1.0)
    if warmup_clip is not None and not hasattr(warmup_clip, "update"):
        raise ValueError(
            f"warmup_clip must be a GradientTransformation or None, got {warmup_clip!r}"
        )
    _engine.check_feedback(feedback, ("raw", "clipped", "clip_target", "skip"))
    ceiling = _engine.resolve_ceiling(max_grad_norm, feedback)
    alpha, thresh = criterion.alpha, criterion.thresh
    # drytorch's StatsCollector: mean and ddof=1 variance of the warm-up
    # sample, the variance kept at its start value 1.0 unless positive.
    statistic = _stats.WarmupEma(None, alpha, warmup_steps, criterion.variance, 1, 1.0)
    score_name = criterion.score_name

    def judge(stats: Any, g: jax.Array, count: jax.Array, aux: Any) -> Judgement:
        warming = count < warmup_steps
        mu, v = stats.mean, stats.var
        active = (mu != 0) & ~warming
        stat = criterion.score(g, mu, v)
        fires = active & (stat > thresh)
        safe = jnp.where(fires, stat, 1.0)
        if criterion.clip_fn is mean_clipping:
            factor = jnp.full_like(safe, criterion.mean_factor)
        else:
            factor = criterion.clip_fn(safe, thresh)
        clip = criterion.clip_value(factor, mu, v)
        high = fires & (g > mu)
        scale = jnp.where(fires, jnp.minimum(1.0, clip / (g + _DIV_EPS)), 1.0)
        extra = {"clip_to": jnp.where(high & (scale < 1) & jnp.isfinite(g), clip, g)}
        if score_name is not None:
            extra[score_name] = jnp.where(warming, 0.0, stat)
        return Judgement(
            threshold=jnp.where(active, criterion.boundary(mu, v, thresh), jnp.inf),
            scale=scale,
            fires=high,
            target=clip,
            warming=warming,
            extra=extra,
        )

    rule = NormRule(
        "hist_clip",
        judge,
        statistic,
        feedback=feedback,
        extra_fields=("clip_to",) if score_name is None else ("clip_to", score_name),
        ceiling=ceiling,
    )
    return _engine.transform(
        rule,
        HistClipState,
        scope=scope,
        name=name,
        axis_name=axis_name,
        leaf_norms=leaf_norms,
        warmup=warmup_clip,
    )
