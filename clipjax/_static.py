"""Static norm clippers and per-leaf normalisers: no statistics, metrics in state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _grouping, _kit, _validation
from clipjax._grouping import Grouping, Scope
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo

Array = jax.Array


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: no statistics, only the shared fields.

    Attributes:
      metrics: this step's metrics and the counters (``clipjax._kit``).
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.clip_by_global_norm(1.0).init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ClipByGlobalNormState), state.info.groups
      (True, ('global',))
    """

    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


class NormalizePerParamState(NamedTuple):
    """State of :func:`normalize_per_param`: no statistics, only the shared fields.

    Attributes:
      metrics: this step's metrics and the counters (``clipjax._kit``).
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: empty (the metrics are per leaf already).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.normalize_per_param().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.NormalizePerParamState), state.info.groups
      (True, ('w',))
    """

    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


class ZScoreNormalizeState(NamedTuple):
    """State of :func:`zscore_normalize`: no statistics, only the shared fields.

    Attributes:
      metrics: this step's metrics and the counters (``clipjax._kit``).
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: empty (the metrics are per leaf already).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.zscore_normalize().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ZScoreNormalizeState), state.info.groups
      (True, ('w',))
    """

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


_CLIP_COUNTERS = ("count", "step", "clipped_count", "nonfinite_count")


def clip_by_global_norm(
    max_norm: float,
    norm_type: float | None = None,
    eps: float = 1e-7,
    *,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Clips updates to a maximum global p-norm, recording metrics in state.

    With ``g`` the p-norm over all leaves (``norm_type`` any ``p > 0`` or
    ``inf``, accumulated in float32)::

        scale = |max_norm| / (g + eps)   where g > |max_norm|   (lucid's and torch's rule)
              = 1                        otherwise, and where g is not finite

    and every leaf is multiplied by ``scale``. With ``eps=0`` and ``p=2`` this
    equals ``optax.clip_by_global_norm``, but reads the gradients once instead
    of several times: one scalar multiplier, no select, no full-size division.

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
      A :class:`~clipjax.ClipTransform` whose state, a
      :class:`ClipByGlobalNormState`, records ``grad_norm``, ``scale``,
      ``clipped`` and the counters.

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
    _kit.check_name(name)
    return _clip_by_norm(max_norm, p, eps, leaf_norms, name, "global", None)


def _clip_by_norm(
    max_norm: Any,
    p: float,
    eps: Any,
    leaf_norms: bool,
    name: str | None,
    scope: Scope,
    axis_name: str | None,
) -> ClipTransform:
    """:func:`clip_by_global_norm` on the groups of ``scope``, norms averaged over
    ``axis_name``: what its ``configure`` returns (:func:`clipjax.hist_clip`
    runs its warm-up clip on its own groups)."""
    _grouping.validate_scope(scope)
    who = name or "clip_by_global_norm"

    def arrays(num_groups: int, dtype: Any = jnp.float32) -> dict[str, Any]:
        metrics = {
            "grad_norm": jnp.zeros((num_groups,), dtype),
            "scale": jnp.ones((num_groups,), dtype),
            "clipped": jnp.zeros((num_groups,), bool),
            **_kit.counters(num_groups, _CLIP_COUNTERS),
        }
        return {"metrics": metrics}

    layout = _kit.layout_of(arrays)

    def init_fn(params: Any) -> Any:
        start = _kit.start(params, scope, "clip_by_global_norm", name, leaf_norms)
        return _kit.new_state(ClipByGlobalNormState, start, arrays(start.num_groups, start.dtype))

    def update_fn(
        updates: Any, state: ClipByGlobalNormState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ClipByGlobalNormState]:
        del params, extra_args
        if p == 2.0:
            grads = _kit.group_norms(
                updates, state, ClipByGlobalNormState, layout, who=who, scope=scope,
                axis_name=axis_name, leaf_norms=leaf_norms,
            )  # fmt: skip
        else:
            grads = _p_norms(updates, state, layout, p, who, scope, axis_name, leaf_norms)
        g = grads.norm
        limit = jnp.abs(jnp.asarray(max_norm, g.dtype))
        ratio = limit / (g + jnp.asarray(eps, g.dtype))
        scale = jnp.where(g > limit, jnp.minimum(ratio, 1.0), 1.0)
        finite = jnp.isfinite(g)
        scale = jnp.where(finite, scale, 1.0).astype(g.dtype)
        clipped = scale < 1
        metrics = _kit.counted(
            state.metrics, finite, clipped, grad_norm=g, scale=scale, clipped=clipped
        )
        new_state = state._replace(**_kit.shared_fields(state, grads, metrics))
        return _kit.scaled(grads, scale, state), new_state

    # optax types a state as OptState (an array tree), not as ClipByGlobalNormState.
    tx = ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
    settings = dict(scope=scope, axis_name=axis_name)
    tx.configure = lambda **overrides: _clip_by_norm(
        max_norm, p, eps, leaf_norms, name, **{**settings, **overrides}
    )
    return tx


def _p_norms(
    updates: Any,
    state: Any,
    layout: Callable[[int], Any],
    p: float,
    who: str,
    scope: Scope,
    axis_name: str | None,
    leaf_norms: bool,
) -> _kit.Norms:
    """:func:`clipjax._kit.group_norms` for the ``p``-norm of each group (the
    leaves' norms, with ``leaf_norms``, stay L2)."""
    leaves, _, treedef, grouping = _kit.check_tree(
        updates, state, ClipByGlobalNormState, layout, who=who, scope=scope
    )
    norm = _grouping.group_norms(leaves, grouping, p)
    per_leaf = None
    if leaf_norms:
        # A stacked leaf's per-slice sums add up to the whole leaf's.
        squares = [jnp.sum(s) if jnp.ndim(s) else s for s in _grouping.leaf_power_sums(leaves)]
        per_leaf = jnp.sqrt(jnp.stack(squares)) if squares else state.leaf_metrics["grad_norm"]
    if axis_name is not None:
        norm, per_leaf = jax.lax.pmean((norm, per_leaf), axis_name)
    return _kit.Norms(norm, leaves, treedef, grouping, per_leaf)


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


# A per-leaf normaliser's step: (leaves, groups, statistics dtype, leaf index)
# -> ([groups] L2 norms before the step, the new leaves).
# A normaliser's metrics: the norm of each leaf and these counters.
_NORMALIZER_FIELDS = {"grad_norm": None}
_NORMALIZER_COUNTERS = ("count", "step", "nonfinite_count")


def normalize_per_param(eps: float = 1e-8, *, name: str | None = None) -> ClipTransform:
    """Scales every leaf to unit L2 norm: ``g / (‖g‖ + eps)``.

    drytorch's ``GradParamNormalizer``. Per leaf::

        out = g * 1 / (‖g‖ + eps)   where ‖g‖ is finite
            = g                     otherwise

    One pass computes all leaf norms (in float32, float64 for float64
    leaves), then each leaf is multiplied by its scalar in its own dtype. A
    leaf with a non-finite norm passes through unchanged and increments
    ``nonfinite_count``. An integer or boolean leaf raises a ``ValueError``
    naming it.

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args``.

    Args:
      eps: added to the norm in the denominator, ``>= 0``.
      name: metrics prefix (default ``normalize_per_param``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose state, a
      :class:`NormalizePerParamState`, records per leaf ``grad_norm`` (before
      normalisation) and the counters ``count``, ``step``, ``nonfinite_count``.

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
    _kit.check_name(name)

    def normalise(leaves: list[Array], grouping: Grouping, dtype: Any, index: Any) -> Any:
        norm = _grouping.group_norms(leaves, grouping)
        finite = jnp.isfinite(norm)
        scale = jnp.where(finite, 1 / (norm + jnp.asarray(eps, dtype)), jnp.ones_like(norm))
        out = _grouping.apply_scales(leaves, grouping, scale, index)
        return out, {"grad_norm": norm}, finite, None

    return _kit.element_transform(
        "normalize_per_param", NormalizePerParamState, normalise, _NORMALIZER_FIELDS,
        _NORMALIZER_COUNTERS, name=name, scope="per_param",
    )  # fmt: skip


def _standardise(x: Array, dtype: Any, eps: Any) -> tuple[Array, Array]:
    """One leaf's norm and the leaf standardised (unchanged where its norm is not finite)."""
    size = x.size
    if size == 0:
        return jnp.zeros((), dtype), x
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
        inverse = jnp.zeros((), dtype)  # Unlike drytorch (NaN): the deviation, 0.
    rough = jnp.where(ok, rough, jnp.zeros_like(rough))
    residual = jnp.where(ok, residual, jnp.zeros_like(residual))
    scale = jnp.where(ok, inverse, jnp.ones_like(inverse))
    return norm, (((xs - rough) - residual) * scale).astype(x.dtype)


def zscore_normalize(eps: float = 1e-8, *, name: str | None = None) -> ClipTransform:
    """Standardises every leaf: ``(g - mean) / (std + eps)``, ``std`` with ddof=1.

    drytorch's ``GradZScoreNormalizer``. Per leaf, over its elements::

        out = (g - mean(g)) / (std(g) + eps)   where ‖g‖ is finite
            = g                                otherwise

    Mean and standard deviation are taken in float32 (float64 for float64
    leaves) by the corrected two-pass algorithm (mean, then the sums of the
    deviations and of their squares), which stays accurate when ``|mean| >>
    std``; the result is cast back to the leaf's dtype. A leaf with a
    non-finite norm passes through unchanged and increments
    ``nonfinite_count``. An integer or boolean leaf raises a ``ValueError``
    naming it.

    Unlike drytorch, which divides by the undefined ddof=1 std of a
    one-element leaf and gives NaN, a one-element leaf becomes 0 (its
    deviation from its own mean).

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args``.

    Args:
      eps: added to the standard deviation in the denominator, ``>= 0``.
      name: metrics prefix (default ``zscore_normalize``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose state, a
      :class:`ZScoreNormalizeState`, records per leaf ``grad_norm`` (L2,
      before normalisation) and the counters ``count``, ``step``,
      ``nonfinite_count``.

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
    _kit.check_name(name)

    def normalise(leaves: list[Array], grouping: Grouping, dtype: Any, index: Any) -> Any:
        del grouping, index
        one = _grouping.per_leaf(_standardise, dtype, eps)
        norms, out = [], []
        for x in leaves:
            norm, standardised = one(x)
            norms.append(norm)
            out.append(standardised)
        norm = jnp.stack(norms) if norms else jnp.zeros((0,), dtype)
        return out, {"grad_norm": norm}, jnp.isfinite(norm), None

    return _kit.element_transform(
        "zscore_normalize", ZScoreNormalizeState, normalise, _NORMALIZER_FIELDS,
        _NORMALIZER_COUNTERS, name=name, scope="per_param",
    )  # fmt: skip
