"""hist_clip: drytorch's HistClipper / ParamHistClipper, clip then observe."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _conditional, _grouping, _kit, _metrics, _stats, _xla
from clipjax._global_norm import clip_by_global_norm
from clipjax._grouping import Grouping, Scope
from clipjax._kit import ClipTransform, TargetFeedback
from clipjax._metrics import GroupInfo


class HistClipState(NamedTuple):
    """State of :func:`hist_clip`: its statistics per group and the warm-up clip's state.

    Attributes:
      mean: ``[groups]`` the criterion's running mean of the norms.
      var: ``[groups]`` its running variance (1.0 and unused under ema).
      sample: the warm-up sample's running sums, ``[groups]`` each.
      nested: the ``warmup_clip`` state (None without one).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.hist_clip().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.HistClipState), state.info.groups, state.mean.shape
      (True, ('global',), (1,))
    """

    mean: jax.Array
    var: jax.Array
    sample: _stats.SampleState
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]
    nested: Any = None

    def statistics(self) -> dict[str, jax.Array]:
        """The statistics :func:`clipjax.metrics` reports: ``mean``, and ``std`` if kept."""
        if "z" in self.metrics:
            return {"mean": self.mean, "std": _metrics.sqrt(self.var)}
        return {"mean": self.mean}


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

    The factor is 0 under :func:`zstat_criterion`, 1 under :func:`ema_criterion`:
    the clip value is ``mu`` under both.

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
      kind: ``"zstat"`` or ``"ema"`` (a label).
      alpha: EMA decay of the statistics.
      thresh: ``z_thresh`` (zstat) or ``r_thresh`` (ema).
      clip_fn: ``(statistic, thresh) -> factor``.
      variance: ``"before_mean"`` (with the mean from before the step) or None.
      score: ``(g, mu, var) -> statistic`` compared with ``thresh``.
      clip_value: ``(factor, mu, var) -> clip value``.
      boundary: ``(mu, var, thresh) -> norm`` above which it fires (the spike boundary).
      mean_factor: the factor :func:`mean_clipping` stands for.
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
    _checks.open_unit("alpha", alpha)
    _checks.positive("z_thresh", z_thresh)
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

    Clip value ``mu * clip_fn(r, r_thresh)``; update ``mu <- alpha mu + (1-alpha) g``.

    Examples:
      >>> import clipjax
      >>> tx = clipjax.hist_clip(clipjax.ema_criterion(r_thresh=1.1, clip_fn=clipjax.mean_clipping))
    """
    _checks.open_unit("alpha", alpha)
    _checks.positive("r_thresh", r_thresh)
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
    *,
    scope: Scope = "global",
    feedback: TargetFeedback = "raw",
    max_grad_norm: float | Literal["auto"] | None = "auto",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Clip by a criterion on the history of gradient norms (drytorch HistClipper).

    Per group, the first ``warmup_steps`` finite norms are collected while
    ``warmup_clip`` is applied; the criterion then starts from their mean and
    ddof=1 variance (1.0 unless positive). Afterwards, with the statistics
    from *before* the step: where the criterion fires the gradient is scaled
    by ``min(1, clip / (g + 1e-6))``, then the statistics observe the step.
    No clipping while ``mu == 0``.

    ``feedback`` is what the statistics observe, with ``B`` the spike
    boundary (``mu + z_thresh * sqrt(v)`` for zstat, ``mu * r_thresh`` for
    ema): the norm (``"raw"``, drytorch's), ``min(g, B)`` (``"clipped"``),
    the clip value on a high-side fire (``"clip_target"``) or nothing then
    (``"skip"``). A NaN/Inf norm passes unchanged and is never observed.
    ``scope="per_param"`` is drytorch's ParamHistClipper; the differences
    from drytorch: :doc:`/reference_drytorch`. A callable ``scope`` goes in
    ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      criterion: :func:`zstat_criterion` (default) or :func:`ema_criterion`.
      warmup_steps: number of finite norms collected before the criterion.
      warmup_clip: transform applied during warm-up, or None; ``"default"``
        (default) means ``clip_by_global_norm(1.0, scope=scope, axis_name=axis_name)``.
      scope: the groups (:class:`~clipjax.ClipTransform`), each with its statistics.
      feedback: ``"raw"`` (default), ``"clipped"``, ``"clip_target"`` or ``"skip"``.
      max_grad_norm: the ceiling (:class:`~clipjax.ClipTransform`), or None;
        ``"auto"`` (default): 1.0 under ``feedback="clipped"``, none otherwise.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``hist_clip``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

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
    criterion, warm, ceiling = _checked(
        criterion, warmup_steps, warmup_clip, feedback, max_grad_norm, scope, axis_name
    )
    alpha, thresh = criterion.alpha, criterion.thresh
    # drytorch's StatsCollector: mean and ddof=1 variance of the warm-up
    # sample, the variance kept at its start value 1.0 unless positive.
    statistic = _stats.WarmupEma(
        alpha=alpha, warmup_steps=warmup_steps, variance=criterion.variance, ddof=1, start_var=1.0
    )
    score_name = criterion.score_name
    fields = ("clip_to",) if score_name is None else ("clip_to", score_name)
    fields += ("headroom",) if ceiling is not None else ()

    # How the warm-up clip skips the steps no group warms up (_conditional.route_of).
    warm_route = _conditional.route_of(warm)
    setup = _kit.setup(
        "hist_clip", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms
    )

    def init_fn(params: Any) -> HistClipState:
        nested = None if warm is None else warm.init(params)
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        mean, var, sample = statistic.init(n, dtype)
        metrics = _kit.norm_metrics(n, dtype, fields, spike=True, ceiling=ceiling is not None)
        state = HistClipState(
            mean, var, sample, metrics,
            common.info, common.leaf_index, common.leaf_metrics, nested,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: HistClipState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, HistClipState]:
        del extra_args
        grads = _kit.norms(setup, updates, state, HistClipState, init_fn)
        g, mu, v, count = grads.norm, state.mean, state.var, state.metrics["count"]
        finite = jnp.isfinite(g)
        warming = count < warmup_steps

        # The criterion, from the statistics before this step (none while mu == 0).
        active = (mu != 0) & ~warming
        score = criterion.score(g, mu, v)
        fires = active & (score > thresh)
        safe = jnp.where(fires, score, 1.0)
        if criterion.clip_fn is mean_clipping:
            factor = jnp.full_like(safe, criterion.mean_factor)
        else:
            factor = criterion.clip_fn(safe, thresh)
        clip = criterion.clip_value(factor, mu, v)
        high = fires & (g > mu)
        boundary = jnp.where(active, criterion.boundary(mu, v, thresh), jnp.inf)
        scale = jnp.where(fires, jnp.minimum(1.0, clip / (g + _DIV_EPS)), 1.0)
        scale = jnp.where(finite, scale, 1.0).astype(g.dtype)
        clip_to = jnp.where(high & (scale < 1) & finite, clip, g)
        capped = None
        threshold = boundary
        if ceiling is not None:
            scale, capped = _kit.ceiling_scale(scale, g, ceiling)
            threshold = jnp.minimum(boundary, ceiling)
            clip_to = jnp.where(capped, ceiling, clip_to)

        # What the statistics learn: the warm-up sample, then the EMAs.
        x, observed = _kit.observation(
            feedback, g, boundary=boundary, target=clip, fires=high & finite
        )
        stats = _stats.WarmupEmaState(mu, v, state.sample)
        stats = _kit.select_groups(observed, statistic.observe(stats, x, count), stats)

        leaves = _grouping.apply_scales(
            grads.leaves, grads.grouping, _xla.computed_once(scale), state.leaf_index
        )
        nested = state.nested
        if warm is not None:
            # The warm-up clip runs on the groups that warm up, only while one
            # does; with a ceiling it sees the capped gradient. hist_clip's own
            # metrics then say what the step did: the warm-up clip's scale and
            # threshold on those groups.
            warm_in = updates if ceiling is None else grads.treedef.unflatten(leaves)
            warming_now = warming & finite
            leaves, nested = _run_warmup(
                warm, warm_route, warm_in, state.nested, params, leaves, grads.grouping,
                warming_now, state.leaf_index,
            )  # fmt: skip
            warm_scale, warm_threshold = _warmup_decision(
                nested, leaves, g * scale, grads.grouping, warming_now
            )
            scale = scale * warm_scale
            clip_to = jnp.where(warming_now & (scale < 1), g * scale, clip_to)
            threshold = jnp.where(warming_now, jnp.minimum(threshold, warm_threshold), threshold)

        scores = {} if score_name is None else {score_name: jnp.where(warming, 0.0, score)}
        if ceiling is not None:
            level = jnp.where(warming, _stats.sample_mean(stats.warmup), stats.mean)
            scores["headroom"] = _kit.headroom(ceiling, level)
        metrics = _kit.step_metrics(
            state.metrics,
            norm=g,
            observed=observed,
            threshold=threshold,
            scale=scale,
            spike=high & finite,
            capped=capped,
            clip_to=clip_to,
            **scores,
        )
        new_state = HistClipState(
            stats.mean, stats.var, stats.warmup, metrics, state.info,
            _kit.kept_index(state), _kit.new_leaf_metrics(grads, state), nested,
        )  # fmt: skip
        return _kit.rebuilt(grads, leaves), new_state

    # optax types a state as OptState (an array tree), not as HistClipState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _checked(
    criterion: Any,
    warmup_steps: Any,
    warmup_clip: Any,
    feedback: Any,
    max_grad_norm: Any,
    scope: Scope,
    axis_name: str | None,
) -> tuple[Criterion, Any, float | None]:
    """Validates hist_clip's arguments; returns the criterion, the warm-up clip and the ceiling."""
    criterion = zstat_criterion() if criterion is None else criterion
    if not isinstance(criterion, Criterion):
        raise ValueError(
            "criterion must come from clipjax.zstat_criterion() or clipjax.ema_criterion(), "
            f"got {criterion!r}"
        )
    _checks.integer("warmup_steps", warmup_steps, minimum=0, static=False)
    if _checks.concrete(warmup_steps) == 0 and not (
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
        warmup_clip = clip_by_global_norm(1.0, scope=scope, axis_name=axis_name)
    if warmup_clip is not None and not hasattr(warmup_clip, "update"):
        raise ValueError(
            f"warmup_clip must be a GradientTransformation or None, got {warmup_clip!r}"
        )
    _checks.feedback(feedback, get_args(TargetFeedback))
    ceiling = _kit.resolve_ceiling(max_grad_norm, feedback)
    return criterion, warmup_clip, ceiling


def _warmup_decision(
    nested: Any, leaves: list[jax.Array], seen: jax.Array, grouping: Grouping, warming: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(scale, threshold)`` per group of the warm-up clip (1 and +inf where not warming)."""
    metrics = nested.metrics if _metrics.is_clipjax_state(nested) else {}
    if "scale" in metrics and metrics["scale"].shape == warming.shape:
        scale = metrics["scale"].astype(seen.dtype)
        threshold = metrics.get("threshold", jnp.full_like(seen, jnp.inf)).astype(seen.dtype)
    else:
        out = _grouping.group_norms(leaves, grouping, 2.0)
        positive = seen > 0
        scale = jnp.where(positive, out / jnp.where(positive, seen, 1.0), 1.0)
        threshold = jnp.full_like(seen, jnp.inf)
    return jnp.where(warming, scale, 1.0), jnp.where(warming, threshold, jnp.inf)


def _run_warmup(
    warmup: Any,
    route: _conditional.Route,
    updates: Any,
    nested: Any,
    params: Any,
    scaled: list[jax.Array],
    grouping: Grouping,
    warming: jax.Array,
    index: tuple[jax.Array, ...],
) -> tuple[list[jax.Array], Any]:
    """The warm-up transform on the groups that warm up, only while one does."""

    def keep_idle(new: Any, old: Any) -> Any:
        if not _metrics.is_clipjax_state(new):
            return new
        if new.metrics["step"].shape != warming.shape:
            return new._replace(metrics=_conditional.idle_metrics(new.metrics))
        metrics = _kit.select_groups(warming, new.metrics, old.metrics)
        idle = _conditional.idle_metrics(metrics)
        return new._replace(metrics=_kit.select_groups(warming, metrics, idle))

    out, new_nested = _conditional.run_if(route, jnp.any(warming), warmup, updates, nested, params)
    mask = _grouping.leaf_scales(grouping, warming, index)
    # A select with a per-leaf mask that fuses into the scaling multiply.
    leaves = [jnp.where(m, w, s) for m, w, s in zip(mask, jax.tree.leaves(out), scaled)]
    kept = jax.tree.map(keep_idle, new_nested, nested, is_leaf=_metrics.is_clipjax_state)
    return leaves, kept
