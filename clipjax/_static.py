"""Static norm clippers and per-leaf normalisers: no statistics, metrics in state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _engine, _grouping, _validation
from clipjax._engine import ElementwiseRule, Judgement, NormRule, Step
from clipjax._grouping import Grouping
from clipjax._metrics import GroupInfo

Array = jax.Array


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: no statistics, only metrics.

    Attributes:
      stats: empty.
      metrics: ``{field: [groups] array}``, read by :func:`clipjax.metrics`.
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.clip_by_global_norm(1.0).init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ClipByGlobalNormState), state.info.groups
      (True, ('global',))
    """

    stats: Any
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


class NormalizePerParamState(NamedTuple):
    """State of :func:`normalize_per_param`: no statistics, only metrics.

    Attributes:
      stats: empty.
      metrics: ``{field: [groups] array}``, read by :func:`clipjax.metrics`.
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.normalize_per_param().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.NormalizePerParamState), state.info.groups
      (True, ('w',))
    """

    stats: Any
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


class ZScoreNormalizeState(NamedTuple):
    """State of :func:`zscore_normalize`: no statistics, only metrics.

    Attributes:
      stats: empty.
      metrics: ``{field: [groups] array}``, read by :func:`clipjax.metrics`.
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.zscore_normalize().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ZScoreNormalizeState), state.info.groups
      (True, ('w',))
    """

    stats: Any
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


def _norm_type(norm_type: Any) -> float:
    _validation.static_number("norm_type", norm_type)
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}") from None
    if not p > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}")
    return p


def clip_by_global_norm(
    max_norm: float,
    norm_type: float | None = None,
    eps: float = 1e-7,
    *,
    leaf_norms: bool = False,
    name: str | None = None,
) -> _engine.ClipTransform:
    """Clips updates to a maximum global p-norm, recording metrics in state.

    The p-norm is taken over all leaves (``norm_type`` any ``p > 0`` or
    ``inf``), accumulated in float32. If ``norm > |max_norm|`` every leaf is
    multiplied by ``|max_norm| / (norm + eps)`` (lucid's and torch's rule);
    otherwise updates pass unchanged. With ``eps=0`` and ``p=2`` this equals
    ``optax.clip_by_global_norm``, but reads the gradients once instead of
    several times: one scalar multiplier, no select, no full-size division.

    A non-finite norm leaves the updates unchanged and increments
    ``nonfinite_count`` (optax would produce NaNs; chain
    ``optax.apply_if_finite`` to drop such steps).

    Static arguments: ``norm_type`` (it picks the norm's arithmetic, a maximum
    or a sum of powers); every other number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args``.

    Args:
      max_norm: the maximum norm, ``!= 0``. A negative value means its
        absolute value (``-1.0`` clips like ``1.0``); zero, which would zero
        every update, raises ``ValueError``.
      norm_type: the order p of the norm, ``> 0`` or ``float("inf")``;
        default 2.0.
      eps: added to the norm in the denominator.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``clip_by_global_norm``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose state records
      ``grad_norm``, ``scale``, ``clipped`` and the counters.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.clip_by_global_norm(1.0)
      >>> g = {"w": jnp.array([3.0, 4.0])}
      >>> out, state = tx.update(g, tx.init(g))
      >>> [round(float(v), 4) for v in out["w"]]
      [0.6, 0.8]

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2013.
    """
    p = _norm_type(2.0 if norm_type is None else norm_type)
    _validation.nonzero_bound("max_norm", max_norm)
    _validation.non_negative("eps", eps)

    def judge(stats: Any, norm: jax.Array, count: jax.Array, aux: Any) -> Judgement:
        limit = jnp.abs(jnp.asarray(max_norm, norm.dtype))
        ratio = limit / (norm + jnp.asarray(eps, norm.dtype))
        # lucid/torch: scale only when the norm exceeds |max_norm|.
        return Judgement(None, jnp.where(norm > limit, jnp.minimum(ratio, 1.0), 1.0))

    rule = NormRule("clip_by_global_norm", judge, ord=p, threshold_name=None)
    return _engine.transform(rule, ClipByGlobalNormState, name=name, leaf_norms=leaf_norms)


def global_norm(tree: Any, norm_type: float = 2.0) -> jax.Array:
    """The p-norm of all leaves of ``tree`` (float32 accumulation; ``inf`` allowed).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> float(clipjax.global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
      5.0
    """
    p = _norm_type(norm_type)
    leaves, _, _ = _grouping.leaves_with_names(tree)
    grouping = _grouping.make_grouping(tree, "global")
    return _grouping.group_norms(leaves, grouping, p)[0]


def normalize_per_param(eps: float = 1e-8, *, name: str | None = None) -> _engine.ClipTransform:
    """Scales every leaf to unit L2 norm: ``g / (‖g‖ + eps)``.

    drytorch's ``GradParamNormalizer``. One pass computes all leaf norms (in
    float32, float64 for float64 leaves), then each leaf is multiplied by the
    scalar ``1 / (‖g‖ + eps)`` in its own dtype. A leaf with a non-finite norm
    passes through unchanged and increments ``nonfinite_count``. An integer or
    boolean leaf raises a ``ValueError`` naming it. ``eps`` may
    be injected with ``optax.inject_hyperparams``.

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args``.

    Args:
      eps: added to the norm in the denominator, ``>= 0``.
      name: metrics prefix (default ``normalize_per_param``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose state records per
      leaf ``grad_norm`` (before normalisation) and the counters ``count``,
      ``step``, ``nonfinite_count``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.normalize_per_param(eps=0.0)
      >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 2.0])}
      >>> out, state = tx.update(g, tx.init(g))
      >>> out["a"].tolist(), out["b"].tolist()
      ([0.6000000238418579, 0.800000011920929], [0.0, 1.0])
      >>> float(clipjax.metrics(state)["normalize_per_param/a/grad_norm"])
      5.0

    References:
      drytorch, ``drytorch.lib.gradient_ops.GradParamNormalizer``.
    """
    _validation.non_negative("eps", eps)

    def kernel(
        leaves: list[Array], _: Any, grouping: Grouping, dtype: Any, index: Any = ()
    ) -> Step:
        _grouping.check_inexact(leaves, grouping, name or "normalize_per_param")
        norm = _grouping.group_norms(leaves, grouping)
        finite = jnp.isfinite(norm)
        scale = jnp.where(finite, 1 / (norm + jnp.asarray(eps, dtype)), jnp.ones_like(norm))
        out = _grouping.apply_scales(leaves, grouping, scale, index)
        return Step(out, {"grad_norm": norm}, finite)

    rule = ElementwiseRule(
        "normalize_per_param", kernel, {"grad_norm": None}, clipped_count=False, indexed=True
    )
    return _engine.transform(rule, NormalizePerParamState, scope="per_param", name=name)


def _standardise(x: Array, dtype: Any, eps: Any) -> tuple[Array, Array, Array]:
    """One leaf's norm, whether it is finite, and the leaf standardised."""
    size = x.size
    if size == 0:
        return jnp.zeros((), dtype), jnp.ones((), bool), x
    # Complex leaves are standardised in complex arithmetic: the deviations
    # keep their phase, the std is that of |deviation|.
    xs = x.astype(jnp.result_type(dtype, x.dtype) if jnp.iscomplexobj(x) else dtype)
    total, squares = _grouping.fused_sums(xs, _grouping.abs_squared(xs, dtype))
    norm = jnp.sqrt(squares)
    ok = jnp.isfinite(norm)
    # Corrected two-pass (Chan, Golub & LeVeque 1983): the second pass sums
    # the deviations from the first mean too, and the output subtracts the two
    # parts separately, so a leaf whose mean is far larger than its spread
    # does not lose its deviations to the rounding of the mean.
    rough = total / size
    deviation = xs - rough
    deviation_sum, deviation_squares = _grouping.fused_sums(
        deviation, _grouping.abs_squared(deviation, dtype)
    )
    residual = deviation_sum / size
    if size > 1:
        centred = deviation_squares - size * jnp.abs(residual) ** 2
        std = jnp.sqrt(jnp.maximum(centred, 0) / (size - 1))
        inverse = 1 / (std + jnp.asarray(eps, dtype))
    else:
        inverse = jnp.zeros((), dtype)  # FIX: drytorch gives NaN here.
    rough = jnp.where(ok, rough, jnp.zeros_like(rough))
    residual = jnp.where(ok, residual, jnp.zeros_like(residual))
    scale = jnp.where(ok, inverse, jnp.ones_like(inverse))
    return norm, ok, (((xs - rough) - residual) * scale).astype(x.dtype)


def zscore_normalize(eps: float = 1e-8, *, name: str | None = None) -> _engine.ClipTransform:
    """Standardises every leaf: ``(g - mean) / (std + eps)``, ``std`` with ddof=1.

    drytorch's ``GradZScoreNormalizer``. Mean and standard deviation are taken
    over the leaf's elements in float32 (float64 for float64 leaves), by the
    corrected two-pass algorithm (mean, then the sums of the deviations and of
    their squares), which stays accurate when ``|mean| >> std``; the result is
    cast back to the leaf's dtype. An integer or boolean leaf raises a
    ``ValueError`` naming it.

    **FIX**: a one-element leaf becomes 0 (its deviation from its own mean);
    drytorch divides by the undefined ddof=1 std and gives NaN. A leaf with a
    non-finite norm passes through unchanged and increments
    ``nonfinite_count``. ``eps`` may be injected with
    ``optax.inject_hyperparams``.

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args``.

    Args:
      eps: added to the standard deviation in the denominator, ``>= 0``.
      name: metrics prefix (default ``zscore_normalize``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose state records per
      leaf ``grad_norm`` (L2, before normalisation) and the counters ``count``,
      ``step``, ``nonfinite_count``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.zscore_normalize(eps=0.0)
      >>> g = {"a": jnp.array([1.0, 2.0, 3.0]), "b": jnp.array([5.0])}
      >>> out, state = tx.update(g, tx.init(g))
      >>> out["a"].tolist(), out["b"].tolist()
      ([-1.0, 0.0, 1.0], [0.0])

    References:
      drytorch, ``drytorch.lib.gradient_ops.GradZScoreNormalizer``.
    """
    _validation.non_negative("eps", eps)

    def kernel(leaves: list[Array], _: Any, grouping: Grouping, dtype: Any) -> Step:
        _grouping.check_inexact(leaves, grouping, name or "zscore_normalize")
        one = _grouping.per_leaf(_standardise, dtype, eps)
        norms, finites, out = [], [], []
        for x in leaves:
            norm, ok, standardised = one(x)
            norms.append(norm)
            finites.append(ok)
            out.append(standardised)
        norm = jnp.stack(norms) if norms else jnp.zeros((0,), dtype)
        finite = jnp.stack(finites) if finites else jnp.zeros((0,), bool)
        return Step(out, {"grad_norm": norm}, finite)

    rule = ElementwiseRule("zscore_normalize", kernel, {"grad_norm": None}, clipped_count=False)
    return _engine.transform(rule, ZScoreNormalizeState, scope="per_param", name=name)
