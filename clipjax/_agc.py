"""agc: Adaptive Gradient Clipping (Brock et al. 2021), unitwise or grouped."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clipjax import _checks, _grouping, _kit, _xla
from clipjax._grouping import AGCScope, Scope
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo

# optax's guard in unitwise_clip, "distinct from the normal eps".
_DIV_EPS = 1e-6

Axis = int | tuple[int, ...] | None


class AGCState(NamedTuple):
    """State of :func:`agc`: the fields every clipper state has (per leaf when unitwise).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.agc().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.AGCState), state.info.groups
      (True, ('w',))
    """

    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


def _exclude_small(path: Any, leaf: Any) -> bool:
    return jnp.ndim(leaf) > 1


def unit_axes(x: Any, axis: Axis = None) -> Any:
    """The reduction axes of a unit norm: ``axis``, or optax's rule by rank."""
    if axis is not None:
        return axis
    shape = jnp.shape(x)
    if sum(d != 1 for d in shape) <= 1:  # scalars and (squeezed) vectors
        return None
    if len(shape) in (2, 3):
        return 0
    if len(shape) in (4, 5):
        return tuple(range(len(shape) - 1))
    raise ValueError(
        f"agc: unitwise scope expects parameters of rank 1 to 5, got shape {shape}; "
        "pass axis= or use a grouped scope for other shapes."
    )


def _unit_norm(x: jax.Array, dtype: Any, axis: Axis, exponent: int = 0) -> jax.Array:
    # exponent: the norm of x * 2**-exponent (see _grouping.overflow_exponent).
    if exponent:
        x = x.astype(jnp.result_type(x.dtype, dtype)) * jnp.asarray(2.0**-exponent, dtype)
    sq = jnp.real(x * jnp.conj(x)).astype(dtype) if jnp.iscomplexobj(x) else x.astype(dtype) ** 2
    return jnp.sqrt(jnp.sum(sq, axis=unit_axes(x, axis), keepdims=True))


def _unit_norms(leaves: list[jax.Array], dtype: Any, axis: Axis) -> list[jax.Array]:
    """Each leaf's unit norms, finite where the unit's elements are (overflow rescaled)."""
    e = _grouping.overflow_exponent(2.0, dtype)
    assert e is not None  # an L2 norm's sum of squares can overflow
    unit_norm = _xla.per_leaf(_unit_norm, dtype, axis)
    scaled_norm = _xla.per_leaf(_unit_norm, dtype, axis, e)
    return _grouping.rescued(
        [unit_norm(x) for x in leaves], lambda: [scaled_norm(x) * 2.0**e for x in leaves]
    )


def _unit_scale(g_unit: jax.Array, w_unit: jax.Array, clipping: Any, eps: Any) -> jax.Array:
    """optax's rule on the unit norms as one division (``1 / 1`` where kept)."""
    max_norm = clipping * jnp.maximum(w_unit, eps)
    keep = (g_unit < max_norm) | ~jnp.isfinite(g_unit)
    return jnp.where(keep, 1.0, max_norm) / jnp.where(keep, 1.0, jnp.maximum(g_unit, _DIV_EPS))


def _scaled(x: jax.Array, g_unit: jax.Array, w_unit: jax.Array, clipping: Any, eps: Any) -> Any:
    """``x`` times its unit scales, in its dtype."""
    return x * _unit_scale(g_unit, w_unit, clipping, eps).astype(x.dtype)


def _leaf_metrics(
    g_units: list[jax.Array],
    w_units: list[jax.Array],
    excluded: list[bool],
    clipping: Any,
    eps: Any,
) -> dict[str, jax.Array]:
    """Each leaf's metrics from its unit norms, leaves with as many units reduced once."""
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(g_units):
        by_size.setdefault(g.size, []).append(i)
    parts: list[list[jax.Array]] = [[], [], [], []]
    order: list[int] = []
    for idx in by_size.values():
        g = jnp.stack([g_units[i].reshape(-1) for i in idx])
        w = jnp.stack([w_units[i].reshape(-1) for i in idx])
        s = _unit_scale(g, w, clipping, eps)
        skip = np.asarray([excluded[i] for i in idx])
        if skip.any():
            s = jnp.where(skip[:, None], jnp.ones_like(s), s)
        # One pass over the stacks for all four sums (the scales are not written out).
        sums = jax.lax.reduce(
            (g * g, w * w, (s < 1).astype(g.dtype), s),
            tuple(jnp.asarray(v, g.dtype) for v in (0, 0, 0, 1)),
            lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2], jnp.minimum(a[3], b[3])),
            (1,),
        )
        for part, value in zip(parts, sums):
            part.append(value)
        order.extend(idx)
    inverse = np.argsort(np.asarray(order))
    g_sq, w_sq, clipped_units, smallest = (
        jnp.concatenate(p)[inverse] if len(by_size) > 1 else p[0] for p in parts
    )
    w_norm = jnp.sqrt(w_sq)
    return {
        "grad_norm": _grouping.rescued(jnp.sqrt(g_sq), lambda: _leaf_norms(g_units)),
        "weight_norm": w_norm,
        "target": clipping * jnp.maximum(w_norm, eps),
        "scale": smallest,
        "clipped": smallest < 1,
        "clipped_fraction": clipped_units / np.asarray([g.size for g in g_units], g_sq.dtype),
    }


def _leaf_norms(units: list[jax.Array]) -> jax.Array:
    """``[leaves]`` L2 norms from each leaf's unit norms (scaled, so overflow stays finite)."""
    return jnp.stack([_grouping.vector_norm(u.reshape(-1)) for u in units])


def agc(
    clipping: float = 0.01,
    eps: float = 1e-3,
    *,
    scope: AGCScope = "unitwise",
    exclude_bias_bn: bool = False,
    axis: Axis = None,
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Adaptive Gradient Clipping: bound each gradient relative to its weights.

    With ``g`` a gradient norm and ``w`` the norm of the same weights::

        unitwise (default), per unit (optax.adaptive_grad_clip, its axis rule):
            max_norm = clipping * max(w, eps)
            scale = 1 where g < max_norm, else max_norm / max(g, 1e-6)
        grouped (scope "global", "per_layer", "per_param" or a callable), per group
        (smartclip's AGC, one scalar per group):
            target = max(eps, clipping * (w + eps))
            scale = min(1, target / (g + eps))

    ``exclude_bias_bn=True`` leaves parameters with ``ndim <= 1`` (biases,
    norm scales) unclipped and out of grouped norms. A non-finite gradient
    norm passes unchanged. Grouped AGC and smartclip's: :doc:`/reference_smartclip`.

    Static arguments: ``axis`` (it picks the unit axes); every other number may be injected.

    Args:
      clipping: the maximum ratio of gradient norm to weight norm (``> 0``).
      eps: floor of the weight norm (unitwise) / additive guard (grouped).
      scope: ``"unitwise"``, ``"global"``, ``"per_layer"``, ``"per_param"`` or
        a callable.
      exclude_bias_bn: do not clip leaves with ``ndim <= 1``.
      axis: unitwise only: the axis or axes a unit's norm is taken over
        (``optax.adaptive_grad_clip``'s ``axis``); None for optax's rule by
        rank (1-D: the whole vector; 2-D and 3-D: axis 0; 4-D: axes 0-2;
        5-D: axes 0-3). Leaves of other ranks need ``axis``.
      axis_name: average the gradient norms (per unit or group) over this mapped axis first.
      leaf_norms: also record each leaf's L2 gradient norm under
        ``agc/leaf/...`` (grouped scopes; unitwise already reports it per leaf).
      name: metrics prefix (default ``agc``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose ``update`` needs ``params``; its
      metrics (per leaf when unitwise, ``scale`` the smallest unit scale):
      :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.agc(clipping=0.01)
      >>> params = {"w": jnp.ones((3, 2))}
      >>> out, state = tx.update({"w": jnp.ones((3, 2))}, tx.init(params), params)
      >>> round(float(out["w"][0, 0]), 4)
      0.01

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without
      Normalization <https://arxiv.org/abs/2102.06171>`_, 2021.
    """
    _checks.positive("clipping", clipping)
    _checks.non_negative("eps", eps)
    if scope == "unitwise":
        return _unitwise(
            clipping, eps, exclude_bias_bn, axis, name, leaf_norms, unit_axis_name=axis_name
        )
    if axis is not None:
        raise ValueError(f'axis applies to scope="unitwise" only, got scope={scope!r}')
    return _grouped(clipping, eps, exclude_bias_bn, name, leaf_norms, scope, axis_name)


def _new_metrics(num_groups: int, dtype: Any, *, unitwise: bool) -> dict[str, Any]:
    """A new state's metrics per group (per leaf when unitwise), with the counters."""
    fields = ("grad_norm", "weight_norm", "target", "scale", "clipped")
    fields += ("clipped_fraction",) if unitwise else ()
    return _kit.new_metrics(num_groups, dtype, fields)


def _param_leaves(params: Any, scope: Scope, info: GroupInfo, who: str) -> list[Any]:
    """The leaves of ``params``, which must have the tree the state was built for."""
    if params is None:
        raise ValueError(f"{who} needs the parameters: call update(updates, state, params).")
    leaves, _, _ = _grouping.leaves_with_names(params)
    _grouping.make_grouping(params, scope).check_matches(
        info.leaves, info.shapes, who, "update's params"
    )
    return leaves


def _grouped(
    clipping: Any,
    eps: Any,
    exclude_bias_bn: bool,
    name: str | None,
    leaf_norms: bool,
    scope: Scope,
    axis_name: str | None,
) -> ClipTransform:
    """Grouped AGC, one scale per group of ``scope``."""
    setup = _kit.setup("agc", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms)

    def init_fn(params: Any) -> AGCState:
        common = _kit.common(setup, params)
        state = AGCState(
            _new_metrics(common.num_groups, common.dtype, unitwise=False),
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: AGCState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AGCState]:
        del extra_args
        grads = _kit.grads_of(setup, updates, state, AGCState, init_fn, dtypes=False)
        leaves, paths, grouping = grads.leaves, grads.paths, grads.grouping
        p_leaves = _param_leaves(params, scope, state.info, setup.who)
        _grouping.check_inexact(leaves, grouping, setup.who)
        # The norms of the kept leaves; a stacked leaf is judged by one layer's
        # slice (what the unstacked model has).
        keep = None
        if exclude_bias_bn:
            views = _grouping.layer_views(leaves, grouping)
            keep = [bool(_exclude_small(p, x)) for p, x in zip(paths, views)]
        partial = _grouping.leaf_power_sums(leaves, 2.0, grouping)
        kept = partial if keep is None else [s * k for s, k in zip(partial, keep)]
        if keep is not None:
            leaves_kept = [x if k else jnp.zeros((), x.dtype) for x, k in zip(leaves, keep)]
            p_leaves = [p if k else jnp.zeros((), p.dtype) for p, k in zip(p_leaves, keep)]
        g = _grouping.group_norms(leaves if keep is None else leaves_kept, grouping, 2.0, kept)
        weight_norm = _grouping.group_norms(p_leaves, grouping)
        per_leaf = None
        if leaf_norms:
            per_leaf = _grouping.leaf_norms(leaves, partial)
        if axis_name is not None:
            g, weight_norm, per_leaf = jax.lax.pmean((g, weight_norm, per_leaf), axis_name)

        # The rule.
        target = jnp.maximum(eps, clipping * (weight_norm + eps))
        scale = jnp.minimum(1.0, target / (g + eps))
        finite = jnp.isfinite(g)
        scale = jnp.where(finite, scale, 1.0).astype(g.dtype)
        metrics = _kit.step_metrics(
            state.metrics, norm=g, observed=finite, scale=scale, target=target,
            weight_norm=weight_norm,
        )  # fmt: skip
        scaled = _grouping.apply_scales(
            leaves, grouping, _xla.computed_once(scale), state.leaf_index
        )
        if keep is not None:
            scaled = [s if k else x for x, s, k in zip(leaves, scaled, keep)]
        grads = grads._replace(norm=g, leaf_norms=per_leaf)
        new_state = AGCState(
            metrics, state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state)
        )
        return _kit.rebuilt(grads, scaled), new_state

    # optax types a state as OptState (an array tree), not as AGCState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _unitwise(
    clipping: Any,
    eps: Any,
    exclude_bias_bn: bool,
    axis: Axis,
    name: str | None,
    leaf_norms: bool,
    *,
    unit_axis_name: str | None,
    scope: Scope = "per_param",
) -> ClipTransform:
    """Unitwise AGC: each leaf scaled unit by unit; metrics per group of ``scope``."""
    setup = _kit.setup("agc", scope=scope, name=name, leaf_norms=leaf_norms, stacked=False)

    def init_fn(params: Any) -> AGCState:
        for x in _grouping.leaves_with_names(params)[0]:
            unit_axes(x, axis)
        common = _kit.common(setup, params)
        state = AGCState(
            _new_metrics(common.num_groups, common.dtype, unitwise=True),
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: AGCState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AGCState]:
        del extra_args
        grads = _kit.grads_of(setup, updates, state, AGCState, init_fn, dtypes=False)
        leaves = grads.leaves
        p_leaves = _param_leaves(params, scope, state.info, setup.who)
        _grouping.check_inexact(leaves, grads.grouping, setup.who)
        dtype = _grouping.norm_dtype(leaves)
        g_units = _unit_norms(leaves, dtype, axis)
        w_units = _unit_norms(p_leaves, dtype, axis)
        if unit_axis_name is not None:
            # Every replica decides from the same (averaged) unit norms.
            g_units = jax.lax.pmean(g_units, unit_axis_name)
        # Each leaf is scaled from its own unit norms: the same few operations for every
        # leaf of a shape, which XLA compiles once. The metrics run on one [leaves, units]
        # stack per unit count: a few operations for the whole tree instead of a dozen
        # small ones per leaf. (Scaling a leaf by a row of a stack puts a constant row
        # offset in its fusion: every leaf's fusion is then distinct and compiled anew.)
        excluded = [exclude_bias_bn and jnp.ndim(x) <= 1 for x in leaves]
        scaled = _xla.per_leaf(_scaled, clipping, eps)
        out = [
            x if skip else scaled(x, g, w)
            for x, g, w, skip in zip(leaves, g_units, w_units, excluded)
        ]
        if leaves:
            step = _leaf_metrics(g_units, w_units, excluded, clipping, eps)
        else:
            step = {f: v for f, v in state.metrics.items() if f not in _kit.COUNTERS}
        norm = step.pop("grad_norm")
        del step["clipped"]  # the smallest unit scale below 1, as step_metrics finds it
        metrics = _kit.step_metrics(state.metrics, norm=norm, observed=jnp.isfinite(norm), **step)
        grads = grads._replace(norm=norm, leaf_norms=norm if leaf_norms else None)
        new_state = AGCState(
            metrics, state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state)
        )
        return _kit.rebuilt(grads, out), new_state

    # optax types a state as OptState (an array tree), not as AGCState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
