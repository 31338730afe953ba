"""ZClip: z-score spike detection on EMA statistics, clip then observe."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _engine, _stats, _validation
from clipjax._engine import Judgement, NormRule
from clipjax._grouping import Scope
from clipjax._metrics import GroupInfo
from clipjax._types import ClipOption, TargetFeedback, ZClipMode

# zclip's fixed guard in the applied multiplier, T / (g + 1e-6).
_DIV_EPS = 1e-6


class ZClipState(NamedTuple):
    """State of :func:`zclip`.

    Attributes:
      stats: EMA mean and variance per group, and the warm-up sample's
        running sums (count, total, sum of squared deviations; ``[groups]``
        each, whatever ``warmup_steps``).
      metrics: ``{field: [groups] array}``, read by :func:`clipjax.metrics`.
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.zclip().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ZClipState), state.info.groups
      (True, ('global',))
    """

    stats: Any
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


def zclip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | None = 1.0,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: ZClipMode = "zscore",
    clip_option: ClipOption | None = None,
    clip_factor: float | None = None,
    skip_update_on_spike: bool = False,
    scope: Scope = "global",
    *,
    feedback: TargetFeedback = "clip_target",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> _engine.ClipTransform:
    """ZClip: adaptive spike clipping from EMA statistics of the gradient norm.

    Warm-up: the first ``warmup_steps`` finite norms are collected and clipped
    only by ``max_grad_norm``; the step that completes the set initialises
    ``mean`` and ``var`` to their mean and population variance. Afterwards,
    from the statistics *before* the step (clip, then observe)::

        std = sqrt(var);  z = (g - mean) / (std + eps)
        zscore mode:     B = mean + z_thresh * (std + eps)    (spike: g > B, i.e. z > z_thresh)
            adaptive_scaling: clip_val = clip_factor * (mean + z_thresh**2 * std / z)
            mean:             clip_val = mean
        percentile mode: B = mean + z_thresh * std,  clip_val = B
        T = min(clip_val if g > B else g, max_grad_norm);  scale = T / (g + 1e-6) if g > T

    and the statistics then observe a value ``v`` chosen by ``feedback``::

        mean <- alpha * mean + (1 - alpha) * v
        var  <- alpha * var + (1 - alpha) * (v - mean_new)**2

    * ``"clip_target"`` (default, the reference zclip rule): ``v = clip_val``
      on a spike, ``g`` otherwise. ``clip_val`` lies below the boundary ``B``
      and tends to ``mean`` as the spike grows, so the statistics can never
      rise past a lasting upward shift of the norm: once the shift exceeds
      about six standard deviations, the std collapses and **every later step
      is clipped to the old mean** for the rest of training (measured by
      ``python benchmarks/follow.py``: after a x2 shift with 5% noise, 100% of
      the later steps are clipped). Keep it to reproduce the reference.
    * ``"clipped"``: ``v = min(g, B)`` on every step: a spike teaches the
      statistics no more than a norm at the boundary would, and a lasting
      rise is learnt (each step at the boundary widens it), so the clipper
      follows a training run and still stops its spikes.
    * ``"raw"``: ``v = g``; a spike inflates the statistics.
    * ``"skip"``: nothing on a spike (the group's ``count`` does not advance);
      a lasting upward shift of the norm can then hold the statistics at the
      old level. ``skip_update_on_spike=True`` is this.

    During warm-up every finite norm is collected as it is.

    Every scope is supported; each group keeps its own statistics and warm-up.
    ``threshold`` reports, on every step, the norm above which the step is
    clipped: ``min(B, max_grad_norm)`` (``max_grad_norm``, or inf without a
    cap, during warm-up), so that ``grad_norm`` against ``threshold`` shows the
    margin. ``clip_to`` is the norm the step leaves with: ``T`` on a clipped
    step, the norm itself otherwise. ``capped`` says the ceiling, not the
    spike rule, was the bound this step (``clipped & ~capped``: a spike
    clip). ``z`` is judged from the statistics before the step (0 during
    warm-up); ``mean`` and ``std`` are reported after it.

    **FIX** (reference ``zclip`` package): a NaN or Inf norm poisons zclip's
    mean and variance for good (and its warm-up mean); here it is kept out of
    the statistics, the group's gradient passes unchanged and
    ``nonfinite_count`` grows. Chain ``optax.apply_if_finite`` to drop such
    steps instead.

    In percentile mode ``clip_option`` and ``clip_factor`` have no effect,
    and ``clip_factor`` none with ``clip_option="mean"``: passing them there
    raises a ``ValueError``, even at their default values.

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args`` (``warmup_steps`` too:
    the warm-up sample is kept as running sums); a callable ``scope`` goes in
    ``static_args`` (inject_hyperparams would call it as a schedule).

    Args:
      alpha: EMA smoothing factor of mean and variance, in (0, 1).
      z_thresh: z-score threshold (``> 0``).
      max_grad_norm: the ceiling: an absolute bound on every step's norm,
        from the first step (warm-up included), under every ``feedback``;
        None for none. Default 1.0, the reference's. It assumes that a
        healthy step's global gradient norm is below 1 (it is, for a mean
        loss over a batch in the language models we measured, whose norm
        settles at 0.3-0.6); where ``capped`` shows most steps capped after
        the first few hundred, the gradients live on a larger scale: raise it,
        or it acts as a static clip at 1.0.
      eps: added to the standard deviation in the z-score.
      warmup_steps: number of finite norms collected before clipping (``>= 1``).
      mode: ``"zscore"`` or ``"percentile"``.
      clip_option: ``"adaptive_scaling"`` or ``"mean"`` (zscore mode only);
        default ``"adaptive_scaling"``.
      clip_factor: multiplier of the adaptive threshold (``> 0``; zscore mode
        with ``"adaptive_scaling"`` only); default 1.0.
      skip_update_on_spike: leave the statistics unchanged on spikes (the
        reference's name for ``feedback="skip"``).
      scope: ``"global"``, ``"per_param"``, ``"per_layer"`` or a callable.
      feedback: ``"clip_target"`` (default), ``"clipped"``, ``"raw"`` or
        ``"skip"``, see above.
      axis_name: average the group norms over this mapped axis first, so every
        replica keeps identical statistics and applies the same scale.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``zclip``).

    Returns:
      A :class:`~clipjax.ClipTransform`. Metrics per group:
      ``grad_norm``, ``threshold``, ``clip_to``, ``scale``, ``clipped``,
      ``mean``, ``std``, ``z`` and the counters.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = optax.chain(clipjax.zclip(feedback="clipped", warmup_steps=5), optax.adam(1e-3))
      >>> params = {"w": jnp.zeros(4)}
      >>> state = tx.init(params)
      >>> for g in [0.10, 0.11, 0.09, 0.10, 0.105, 5.0]:  # global norms; a spike last
      ...     _, state = tx.update({"w": jnp.full(4, g / 2)}, state, params)
      >>> m = clipjax.metrics(state)
      >>> bool(m["zclip/global/clipped"]), float(m["zclip/global/threshold"]) < 0.13
      (True, True)
      >>> float(m["zclip/global/clip_to"]) < float(m["zclip/global/threshold"])
      True
      >>> bool(m["zclip/global/capped"])  # a spike clip, below the 1.0 ceiling
      False

    References:
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025; package ``zclip``.
    """
    _validation.open_unit("alpha", alpha)
    _validation.positive("z_thresh", z_thresh)
    _validation.non_negative("eps", eps)
    _validation.integer("warmup_steps", warmup_steps, minimum=1, static=False)
    _validation.choice("mode", mode, ("zscore", "percentile"))
    if mode == "percentile" and clip_option is not None:
        raise ValueError(
            f'clip_option={clip_option!r} has no effect with mode="percentile", which '
            "clips to its boundary mean + z_thresh * std; leave clip_option out"
        )
    if clip_factor is not None and (mode == "percentile" or clip_option == "mean"):
        raise ValueError(
            f"clip_factor={clip_factor!r} has no effect with mode={mode!r}"
            + ("" if clip_option is None else f", clip_option={clip_option!r}")
            + ": it scales adaptive_scaling's clip value only; leave clip_factor out"
        )
    clip_option = "adaptive_scaling" if clip_option is None else clip_option
    clip_factor = 1.0 if clip_factor is None else clip_factor
    _validation.choice("clip_option", clip_option, ("adaptive_scaling", "mean"))
    _validation.positive("clip_factor", clip_factor)
    _engine.check_feedback(feedback, ("clip_target", "clipped", "raw", "skip"))
    if skip_update_on_spike:
        if feedback not in ("clip_target", "skip"):
            raise ValueError(
                f'skip_update_on_spike=True is feedback="skip"; it conflicts with '
                f"feedback={feedback!r}"
            )
        feedback = "skip"
    if max_grad_norm is not None:
        _validation.positive("max_grad_norm", max_grad_norm)
    cap = math.inf if max_grad_norm is None else max_grad_norm
    statistic = _stats.WarmupEma(None, alpha, warmup_steps, "after_mean", ddof=0)

    def judge(stats: Any, g: jax.Array, count: jax.Array, aux: Any) -> Judgement:
        warming = count < warmup_steps
        limit = jnp.asarray(cap, g.dtype)
        std = jnp.sqrt(stats.var)
        z = (g - stats.mean) / (std + eps)
        if mode == "percentile":
            boundary = stats.mean + z_thresh * std
            spike = g > boundary
            clip_val = boundary
        else:
            boundary = stats.mean + z_thresh * (std + eps)
            spike = z > z_thresh
            if clip_option == "mean":
                clip_val = stats.mean
            else:
                # Only read where spike (z > z_thresh > 0), so z is never 0 there.
                safe_z = jnp.where(spike, z, 1.0)
                clip_val = clip_factor * (stats.mean + z_thresh**2 * std / safe_z)
        applied = jnp.minimum(jnp.where(spike & ~warming, clip_val, g), limit)
        # zclip uses torch's clip_grad_norm_ rule in warm-up (min(1, c/(g+1e-6)))
        # and scales only when g > T afterwards.
        ratio = jnp.minimum(1.0, jnp.where(warming, limit, applied) / (g + _DIV_EPS))
        scale = jnp.where(warming | (g > applied), ratio, 1.0)
        finite = jnp.isfinite(g)
        return Judgement(
            jnp.where(warming, limit, jnp.minimum(boundary, limit)),
            scale,
            fires=spike & ~warming,
            boundary=boundary,
            target=clip_val,
            extra={
                "z": jnp.where(warming, jnp.zeros_like(z), z),
                "clip_to": jnp.where(finite & (scale < 1), applied, g),
            },
        )

    rule = NormRule(
        "zclip",
        judge,
        statistic,
        feedback=feedback,
        extra_fields=("z", "clip_to"),
        ceiling=max_grad_norm,
    )
    return _engine.transform(
        rule, ZClipState, scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms
    )
