"""Element-wise static clippers: clamp every element to a bound, no statistics kept."""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clipjax import _checks, _grouping, _kit, _percentile, _xla
from clipjax._grouping import Grouping, Scope
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo

Array = jax.Array

PercentileMethod = Literal["auto", "exact", "approx"]
PERCENTILE_METHODS = ("auto", "exact", "approx")
PERCENTILE_SCOPES = ("per_param", "per_layer", "global")


class ClipByValueState(NamedTuple):
    """State of :func:`clip_by_value`: the fields every clipper state has.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.clip_by_value(1.0).init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ClipByValueState), state.info.groups
      (True, ('global',))
    """

    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


class ClipByPercentileState(NamedTuple):
    """State of :func:`clip_by_percentile`: the fields every clipper state has.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.clip_by_percentile(90.0).init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ClipByPercentileState), state.info.groups
      (True, ('w',))
    """

    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


def _group_sum(per_leaf: list[Array], grouping: Grouping, dtype: Any) -> Array:
    """Sums per-leaf scalars into their groups, ``[groups]``."""
    if not per_leaf:
        return jnp.zeros((grouping.num_groups,), dtype)
    stacked = jnp.stack([jnp.asarray(v, dtype) for v in per_leaf])
    if grouping.num_groups == 1:
        return jnp.sum(stacked)[None]
    return jax.ops.segment_sum(
        stacked, np.asarray(grouping.leaf_groups), num_segments=grouping.num_groups
    )


def _group_sizes(grouping: Grouping) -> np.ndarray:
    sizes = np.zeros((grouping.num_groups,), np.float64)
    for shape, group in zip(grouping.leaf_shapes, grouping.leaf_groups):
        sizes[group] += math.prod(shape)
    return sizes


def _square_and_count(x: Array, b: Array, dtype: Any) -> tuple[Array, Array]:
    """A leaf's sum of squares and its number of elements with ``|x| > b``, in one read."""
    b = b.astype(jnp.abs(x).dtype)
    square, count = _xla.fused_sums(
        _grouping.abs_squared(x, dtype), (jnp.abs(x) > b).astype(jnp.int32)
    )
    return square, count


def _norms_and_clipped(
    leaves: list[Array], grouping: Grouping, bound: Array, dtype: Any, index: Any = ()
) -> tuple[Array, Array, Array]:
    """Per group the L2 norm and the number of elements with ``|x| > b``; per leaf the norm."""
    one = _xla.per_leaf(_square_and_count, dtype)
    squares, over = [], []
    for x, b in zip(leaves, _grouping.leaf_scales(grouping, bound, index)):
        square, count = one(x, b)
        squares.append(square)
        over.append(count)
    count = _group_sum(over, grouping, dtype)
    if not leaves:
        return jnp.sqrt(_group_sum(squares, grouping, dtype)), count, jnp.zeros((0,), dtype)
    e = _grouping.overflow_exponent(2.0, dtype)
    assert e is not None

    def norms(sums: list[Array], scale: float = 1.0) -> tuple[Array, Array]:
        group = jnp.sqrt(_group_sum(sums, grouping, dtype)) * scale
        return group, jnp.sqrt(jnp.stack(sums)) * scale

    # Where a sum overflowed, both are taken again, in one pass, from scaled leaves.
    scaled = lambda: norms(_grouping.leaf_power_sums(leaves, 2.0, None, e), 2.0**e)
    norm, leaf_norm = _grouping.rescued(norms(squares), scaled)
    return norm, count, leaf_norm


def clamp_leaf(x: Array, b: Array) -> Array:
    """``clip(x, -b, b)`` in the leaf's dtype; a complex element keeps its phase."""
    if jnp.iscomplexobj(x):
        b = b.astype(jnp.abs(x).dtype)
        magnitude = jnp.abs(x)
        return jnp.where(magnitude > b, x * (b / jnp.maximum(magnitude, b)), x)
    return jnp.clip(x, -b.astype(x.dtype), b.astype(x.dtype))


def _clamp(leaves: list[Array], grouping: Grouping, bound: Array, index: Any = ()) -> list[Array]:
    """``clip(x, -b, b)`` per leaf, ``b`` its group's bound in the leaf's dtype."""
    one = _xla.per_leaf(clamp_leaf)
    return [one(x, b) for x, b in zip(leaves, _grouping.leaf_scales(grouping, bound, index))]


def _fraction(counts: Array, grouping: Grouping, dtype: Any) -> Array:
    sizes = np.maximum(_group_sizes(grouping), 1)
    return counts / jnp.asarray(sizes, dtype)


def clip_by_value(
    max_abs: float,
    *,
    scope: Scope = "global",
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Clamps every element of the updates to ``[-|max_abs|, |max_abs|]``.

    For ``max_abs > 0`` this equals ``optax.clip(max_abs)``, non-finite elements
    included (``±inf`` become ``±max_abs``, NaN stays NaN). A complex element
    keeps its phase. ``scope`` only groups the metrics; a callable one goes in
    ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      max_abs: the largest magnitude kept; a negative value means its
        absolute value, zero raises ``ValueError``.
      scope: grouping of the metrics: ``"global"``, ``"per_param"``,
        ``"per_layer"`` or a callable ``(path, leaf) -> str``.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``clip_by_value``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.clip_by_value(1.0)
      >>> g = {"w": jnp.array([-3.0, 0.5, 2.0, 1.0])}
      >>> out, state = tx.update(g, tx.init(g))
      >>> out["w"].tolist()
      [-1.0, 0.5, 1.0, 1.0]
      >>> float(clipjax.metrics(state)["clip_by_value/global/clipped_fraction"])
      0.5

    References:
      Mikolov, `Statistical language models based on neural networks
      <https://www.fit.vut.cz/study/phd-thesis-file/283/283.pdf>`_, 2012
      (section 3.2.2: clipping gradient values).
    """
    _checks.nonzero_bound("max_abs", max_abs)
    setup = _kit.setup(
        "clip_by_value", scope=scope, name=name, leaf_norms=leaf_norms, stacked=False
    )

    def init_fn(params: Any) -> ClipByValueState:
        common = _kit.common(setup, params)
        fields = ("grad_norm", "clipped_fraction", "clipped")
        state = ClipByValueState(
            _kit.new_metrics(common.num_groups, common.dtype, fields),
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: ClipByValueState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ClipByValueState]:
        del params, extra_args
        grads = _kit.grads_of(setup, updates, state, ClipByValueState, init_fn)
        leaves, grouping = grads.leaves, grads.grouping
        dtype = _grouping.norm_dtype(leaves)
        limit = jnp.abs(jnp.asarray(max_abs, dtype))
        bound = jnp.broadcast_to(limit, (grouping.num_groups,))  # the same for every group
        norm, counts, leaf_norm = _norms_and_clipped(leaves, grouping, bound, dtype)
        fraction = _fraction(counts, grouping, dtype)
        out = _clamp(leaves, grouping, bound)
        metrics = _kit.step_metrics(
            state.metrics, norm=norm, observed=jnp.isfinite(norm), clipped=fraction > 0,
            clipped_fraction=fraction,
        )  # fmt: skip
        grads = grads._replace(norm=norm, leaf_norms=leaf_norm if leaf_norms else None)
        new_state = ClipByValueState(
            metrics, state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state)
        )
        return _kit.rebuilt(grads, out), new_state

    # optax types a state as OptState (an array tree), not as ClipByValueState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def clip_by_percentile(
    percentile: float,
    *,
    scope: Scope = "per_param",
    method: PercentileMethod = "auto",
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Clamps the updates to the ``percentile``-th percentile of their magnitudes.

    Per group, the bound ``b`` is the linearly interpolated percentile
    (numpy's default method) of ``|g|`` over the group's elements; then
    ``clip(g, -b, b)``.

    ``method="exact"`` sorts the group's magnitudes; ``"approx"`` is
    :func:`clipjax.approx_percentile`'s radix select, within a relative
    ``2^-17`` of the exact bound; ``"auto"`` is exact for groups of up to
    ``AUTO_EXACT_MAX_SIZE`` (4096) elements and approximate above.

    A group with a NaN or inf element passes unchanged (``bound = inf``). A
    complex element keeps its phase; with bfloat16/float16 leaves the bound is
    rounded to the leaf dtype. A callable ``scope`` goes in ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      percentile: on the 0-100 scale, in ``(1, 100]`` (100: nothing clipped); a
        value in ``(0, 1]``, almost surely a fraction, raises ``ValueError``.
      scope: ``"per_param"``, ``"per_layer"``, ``"global"`` or a callable
        ``(path, leaf) -> str``.
      method: ``"auto"``, ``"exact"`` or ``"approx"``.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``clip_by_percentile``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.clip_by_percentile(50.0)
      >>> g = {"w": jnp.array([-4.0, 1.0, 2.0, -3.0])}
      >>> out, state = tx.update(g, tx.init(g))
      >>> out["w"].tolist()
      [-2.5, 1.0, 2.0, -2.5]
      >>> float(clipjax.metrics(state)["clip_by_percentile/w/bound"])
      2.5

    References:
      Andrew, Thakkar, McMahan, Ramaswamy, `Differentially private learning
      with adaptive clipping <https://arxiv.org/abs/1905.03871>`_, 2021
      (quantile-based clipping bounds).
    """
    _checks.percentile("percentile", percentile)
    _checks.choice("method", method, PERCENTILE_METHODS)
    setup = _kit.setup(
        "clip_by_percentile", scope=scope, name=name, leaf_norms=leaf_norms,
        scopes=PERCENTILE_SCOPES, stacked=False,
    )  # fmt: skip

    def init_fn(params: Any) -> ClipByPercentileState:
        common = _kit.common(setup, params)
        fields = ("grad_norm", "bound", "clipped_fraction", "clipped")
        state = ClipByPercentileState(
            _kit.new_metrics(common.num_groups, common.dtype, fields),
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: ClipByPercentileState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ClipByPercentileState]:
        del params, extra_args
        grads = _kit.grads_of(setup, updates, state, ClipByPercentileState, init_fn)
        leaves, grouping, index = grads.leaves, grads.grouping, state.leaf_index
        dtype = _grouping.norm_dtype(leaves)
        select = _xla.per_leaf(_percentile.select, percentile, method)
        bounds = [select([leaves[i] for i in members])[0] for members in grouping.members]
        bound = jnp.stack(bounds).astype(dtype) if bounds else jnp.zeros((0,), dtype)
        norm, counts, leaf_norm = _norms_and_clipped(leaves, grouping, bound, dtype, index)
        finite = jnp.isfinite(norm)
        # Selects on [groups] only: a non-finite group's leaves pass unchanged.
        bound = jnp.where(finite, bound, jnp.inf)
        fraction = _fraction(jnp.where(finite, counts, jnp.zeros_like(counts)), grouping, dtype)
        out = _clamp(leaves, grouping, bound, index)
        metrics = _kit.step_metrics(
            state.metrics, norm=norm, observed=finite, clipped=fraction > 0, bound=bound,
            clipped_fraction=fraction,
        )  # fmt: skip
        grads = grads._replace(norm=norm, leaf_norms=leaf_norm if leaf_norms else None)
        new_state = ClipByPercentileState(
            metrics, state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state)
        )
        return _kit.rebuilt(grads, out), new_state

    # optax types a state as OptState (an array tree), not as ClipByPercentileState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
