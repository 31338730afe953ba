"""Static norm clippers and per-leaf normalisers: no statistics, metrics in state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _checks, _grouping, _kit, _xla
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo

Array = jax.Array


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: the fields every clipper state has.

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
    """State of :func:`normalize_per_param`: the fields every clipper state has.

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
    """State of :func:`zscore_normalize`: the fields every clipper state has.

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
    _checks.static_number("norm_type", norm_type)
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
    scope: Scope = "global",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Clips updates to a maximum global p-norm, recording metrics in state.

    With ``g`` the p-norm over all leaves (``norm_type`` any ``p > 0`` or
    ``inf``, accumulated in float32)::

        scale = |max_norm| / (g + eps)   where g > |max_norm|   (lucid's and torch's rule)
              = 1                        otherwise, and where g is not finite

    and every leaf is multiplied by ``scale``. With ``eps=0`` and ``p=2`` this
    equals ``optax.clip_by_global_norm``. A non-finite norm leaves the updates
    unchanged and increments ``nonfinite_count``.

    Static arguments: ``norm_type`` (it picks the norm's arithmetic, a maximum or a sum of
    powers); every other number may be injected.

    Args:
      max_norm: the maximum norm; a negative value means its absolute value,
        zero raises ``ValueError``.
      norm_type: the order p of the norm, ``> 0`` or ``float("inf")``;
        default 2.0.
      eps: added to the norm in the denominator.
      scope: the groups (:class:`~clipjax.ClipTransform`), each clipped on its own.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``clip_by_global_norm``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

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
    _checks.nonzero_bound("max_norm", max_norm)
    _checks.non_negative("eps", eps)
    setup = _kit.setup(
        "clip_by_global_norm", scope=scope, name=name, axis_name=axis_name,
        leaf_norms=leaf_norms, p=p,
    )  # fmt: skip

    def init_fn(params: Any) -> ClipByGlobalNormState:
        common = _kit.common(setup, params)
        state = ClipByGlobalNormState(
            _kit.norm_metrics(common.num_groups, common.dtype),
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: ClipByGlobalNormState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ClipByGlobalNormState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, ClipByGlobalNormState, init_fn)
        g = grads.norm
        limit = jnp.abs(jnp.asarray(max_norm, g.dtype))
        ratio = limit / (g + jnp.asarray(eps, g.dtype))
        scale = jnp.where(g > limit, jnp.minimum(ratio, 1.0), 1.0)
        finite = jnp.isfinite(g)
        scale = jnp.where(finite, scale, 1.0).astype(g.dtype)
        metrics = _kit.step_metrics(
            state.metrics, norm=g, observed=finite, threshold=jnp.broadcast_to(limit, g.shape),
            scale=scale,
        )  # fmt: skip
        new_state = ClipByGlobalNormState(
            metrics, state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state)
        )
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as ClipByGlobalNormState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


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


_COUNTERS = ("count", "step", "nonfinite_count")


def normalize_per_param(eps: float = 1e-8, *, name: str | None = None) -> ClipTransform:
    """Scales every leaf to unit L2 norm: ``g / (‖g‖ + eps)``.

    Per leaf, with norms in float32 (float64 for float64 leaves)::

        out = g * 1 / (‖g‖ + eps)   where ‖g‖ is finite
            = g                     otherwise (nonfinite_count += 1)

    Static arguments: none; every number may be injected.

    Args:
      eps: added to the norm in the denominator, ``>= 0``.
      name: metrics prefix (default ``normalize_per_param``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

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
    _checks.non_negative("eps", eps)
    return _normalizer("normalize_per_param", NormalizePerParamState, eps, name=name)


def _standardise(x: Array, dtype: Any, eps: Any) -> tuple[Array, Array]:
    """One leaf's norm and the leaf standardised (unchanged where its norm is not finite)."""
    size = x.size
    if size == 0:
        return jnp.zeros((), dtype), x
    # Complex leaves are standardised in complex arithmetic: the deviations
    # keep their phase, the std is that of |deviation|.
    xs = x.astype(jnp.result_type(dtype, x.dtype) if jnp.iscomplexobj(x) else dtype)
    total, squares = _xla.fused_sums(xs, _grouping.abs_squared(xs, dtype))
    norm = jnp.sqrt(squares)
    ok = jnp.isfinite(norm)
    # Corrected two-pass (Chan, Golub & LeVeque 1983): the second pass sums
    # the deviations from the first mean too, and the output subtracts the two
    # parts separately, so a leaf whose mean is far larger than its spread
    # does not lose its deviations to the rounding of the mean.
    rough = total / size
    deviation = xs - rough
    deviation_sum, deviation_squares = _xla.fused_sums(
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

    Per leaf, over its elements, in float32 (float64 for float64 leaves)::

        out = (g - mean(g)) / (std(g) + eps)   where ‖g‖ is finite
            = g                                otherwise (nonfinite_count += 1)

    A one-element leaf becomes 0 (:doc:`/reference_drytorch`).

    Static arguments: none; every number may be injected.

    Args:
      eps: added to the standard deviation in the denominator, ``>= 0``.
      name: metrics prefix (default ``zscore_normalize``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

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
    _checks.non_negative("eps", eps)
    return _normalizer("zscore_normalize", ZScoreNormalizeState, eps, name=name)


def _normalizer(
    algo: str,
    state_class: type,
    eps: Any,
    *,
    name: str | None,
    scope: Scope = "per_param",
    axis_name: str | None = None,
) -> ClipTransform:
    """:func:`normalize_per_param` or :func:`zscore_normalize` on the groups of ``scope``."""
    del axis_name
    setup = _kit.setup(algo, scope=scope, name=name, stacked=False)

    def init_fn(params: Any) -> Any:
        common = _kit.common(setup, params)
        # A normaliser's metrics: the norm of each leaf and these counters.
        metrics = _kit.new_metrics(common.num_groups, common.dtype, ("grad_norm",), _COUNTERS)
        state = state_class(metrics, common.info, common.leaf_index, common.leaf_metrics)
        return _kit.owned(params, state)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del params, extra_args
        grads = _kit.grads_of(setup, updates, state, state_class, init_fn)
        leaves, grouping = grads.leaves, grads.grouping
        dtype = _grouping.norm_dtype(leaves)
        if algo == "normalize_per_param":
            norm = _grouping.group_norms(leaves, grouping)
            finite = jnp.isfinite(norm)
            scale = jnp.where(finite, 1 / (norm + jnp.asarray(eps, dtype)), jnp.ones_like(norm))
            out = _grouping.apply_scales(leaves, grouping, scale, state.leaf_index)
        else:
            one = _xla.per_leaf(_standardise, dtype, eps)
            norms, out = [], []
            for x in leaves:
                norm, standardised = one(x)
                norms.append(norm)
                out.append(standardised)
            norm = jnp.stack(norms) if norms else jnp.zeros((0,), dtype)
            finite = jnp.isfinite(norm)
        metrics = _kit.step_metrics(state.metrics, norm=norm, observed=finite)
        new_state = state_class(metrics, state.info, _kit.kept_index(state), state.leaf_metrics)
        return _kit.rebuilt(grads, out), new_state

    return ClipTransform(init_fn, update_fn)
