"""Element-wise static clippers and per-leaf normalisers (SPEC 4.6).

No statistics carry over between steps; each state only records the metrics of
the last step and the counters. The four transforms share one skeleton
(:func:`_static_transform`): group the leaves by ``scope``, run the
transform's kernel, record its ``[groups]`` metrics and advance the counters.

Non-finite input, for all four: a group whose L2 norm is NaN or infinite (any
NaN or inf element; also a float32 norm that overflows above ~1.8e19)
increments ``nonfinite_count`` and does not increment ``count``.
``clip_by_value`` still clamps it element-wise, as ``optax.clip`` does
(``±inf`` become ``±max_abs``, NaN stays NaN); the other three pass such a
leaf (group) through unchanged rather than spreading NaN over it. Chain
``optax.apply_if_finite`` to drop such steps altogether.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clipjax import _engine, _grouping, _metrics, _percentile, _validation
from clipjax._grouping import Grouping, Scope

Array = jax.Array

ClipByValueState = _engine.register_algo(
    "clip_by_value",
    "State of :func:`clip_by_value`: no statistics, only metrics.",
    "ClipByValueState",
)
ClipByPercentileState = _engine.register_algo(
    "clip_by_percentile",
    "State of :func:`clip_by_percentile`: no statistics, only metrics.",
    "ClipByPercentileState",
)
NormalizePerParamState = _engine.register_algo(
    "normalize_per_param",
    "State of :func:`normalize_per_param`: no statistics, only metrics.",
    "NormalizePerParamState",
)
ZScoreNormalizeState = _engine.register_algo(
    "zscore_normalize",
    "State of :func:`zscore_normalize`: no statistics, only metrics.",
    "ZScoreNormalizeState",
)

_STATE_CLASSES = {
    "clip_by_value": ClipByValueState,
    "clip_by_percentile": ClipByPercentileState,
    "normalize_per_param": NormalizePerParamState,
    "zscore_normalize": ZScoreNormalizeState,
}

PERCENTILE_METHODS = ("auto", "exact", "approx")
PERCENTILE_SCOPES = ("per_param", "per_layer", "global")


class _Step(NamedTuple):
    """What a kernel returns for one update.

    Attributes:
      leaves: the new leaves, each in its input dtype.
      metrics: ``{field: [groups] array}`` for this step.
      finite: ``[groups]`` bool, the group's norm is finite.
      clipped: ``[groups]`` bool, some element was clipped (None for normalisers).
    """

    leaves: list[Array]
    metrics: dict[str, Array]
    finite: Array
    clipped: Array | None


Kernel = Callable[[list[Array], Grouping, Any], _Step]


def _check_name(name: Any) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty str, got {name!r}")


def _static_transform(
    algo: str,
    scope: Scope,
    name: str | None,
    fields: dict[str, Any],
    kernel: Kernel,
) -> _engine.ClipTransform:
    """The shared init/update of the static transforms.

    Args:
      algo: the factory's name (metrics prefix and state class).
      scope: how leaves form groups.
      name: user prefix replacing ``algo`` in metrics.
      fields: ``{metric: dtype}``; ``None`` means the statistics dtype
        (float32, float64 for float64 trees). Counters are added.
      kernel: ``(leaves, grouping, stats_dtype) -> _Step``.
    """
    with_clipped_count = "clipped_fraction" in fields
    state_class = _STATE_CLASSES[algo]

    def counters(num_groups: int) -> dict[str, Array]:
        out = _engine.counters(num_groups)
        if not with_clipped_count:
            del out["clipped_count"]
        return out

    def init_fn(params: Any) -> Any:
        _metrics.ensure_serializable()
        leaves, _, _ = _grouping.leaves_with_names(params)
        grouping = _grouping.make_grouping(params, scope)
        dtype = _grouping.norm_dtype(leaves)
        num_groups = grouping.num_groups
        metrics = {
            field: jnp.zeros((num_groups,), dtype if kind is None else kind)
            for field, kind in fields.items()
        }
        metrics.update(counters(num_groups))
        info = _metrics.GroupInfo(algo, name, grouping.names, grouping.fingerprint)
        return _engine.own_buffers(state_class((), metrics, info, None))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del params, extra_args
        leaves, _, treedef = _grouping.leaves_with_names(updates)
        grouping = _grouping.make_grouping(updates, scope)
        _engine._check_state(state, grouping, state.info)
        step = kernel(leaves, grouping, _grouping.norm_dtype(leaves))
        old = state.metrics
        clipped = step.clipped
        previous = dict(old)
        if clipped is None:
            clipped = jnp.zeros_like(step.finite)
            previous["clipped_count"] = jnp.zeros_like(old["count"])
        advanced = _engine.advance_counters(previous, step.finite, clipped, step.finite)
        metrics = dict(step.metrics)
        metrics.update({k: v for k, v in advanced.items() if k in old})
        metrics = {k: jnp.asarray(v).astype(old[k].dtype) for k, v in metrics.items()}
        new_updates = jax.tree_util.tree_unflatten(treedef, step.leaves)
        return new_updates, state._replace(metrics=metrics)

    return _engine.ClipTransform(init_fn, update_fn)


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


def _fused_sums(*terms: Array) -> tuple[Array, ...]:
    """The sums of several same-shape element-wise terms, in one pass.

    One variadic reduce: XLA reads the leaf once for all the sums, where
    separate ``jnp.sum`` calls read it once each (and an int32 count even
    materialises its converted input on CPU).
    """
    flat = tuple(t.reshape(-1) for t in terms)
    zeros = tuple(jnp.zeros((), t.dtype) for t in flat)
    return tuple(jax.lax.reduce(flat, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), (0,)))


def _norms_and_clipped(
    leaves: list[Array], grouping: Grouping, bound: Array, dtype: Any
) -> tuple[Array, Array]:
    """Per group, the L2 norm and the number of elements with ``|x| > b``.

    ``bound`` is ``[groups]``, compared in the leaf's dtype (the dtype the
    clamp uses). Both come from one read of each leaf.
    """
    squares, over = [], []
    for x, group in zip(leaves, grouping.leaf_groups):
        xs = x.astype(dtype)
        b = bound[group].astype(x.dtype)
        square, count = _fused_sums(xs * xs, (jnp.abs(x) > b).astype(jnp.int32))
        squares.append(square)
        over.append(count)
    norm = jnp.sqrt(_group_sum(squares, grouping, dtype))
    return norm, _group_sum(over, grouping, dtype)


def _clamp(leaves: list[Array], grouping: Grouping, bound: Array) -> list[Array]:
    """``clip(x, -b, b)`` per leaf, ``b`` its group's bound cast to the leaf's dtype."""
    return [
        jnp.clip(x, -bound[g].astype(x.dtype), bound[g].astype(x.dtype))
        for x, g in zip(leaves, grouping.leaf_groups)
    ]


def _fraction(counts: Array, grouping: Grouping, dtype: Any) -> Array:
    sizes = np.maximum(_group_sizes(grouping), 1)
    return counts / jnp.asarray(sizes, dtype)


def clip_by_value(
    max_abs: float, *, scope: Scope = "global", name: str | None = None
) -> _engine.ClipTransform:
    """Clamps every element of the updates to ``[-|max_abs|, |max_abs|]``.

    Element-wise ``clip(g, -|max_abs|, |max_abs|)``; for ``max_abs > 0`` the
    output equals ``optax.clip(max_abs)``, including non-finite elements
    (``±inf`` become ``±max_abs``, NaN stays NaN). ``scope`` only decides how
    the metrics are grouped. Leaves must be real-valued.

    ``max_abs`` may be injected and scheduled with ``optax.inject_hyperparams``;
    ``scope`` is static.

    Args:
      max_abs: the largest magnitude kept; its absolute value is used.
      scope: grouping of the metrics: ``"global"``, ``"per_param"``,
        ``"per_layer"`` or a callable ``(path, leaf) -> str``.
      name: metrics prefix (default ``clip_by_value``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state records per
      group ``grad_norm`` (L2, before clipping), ``clipped_fraction`` (share of
      elements with ``|g| > |max_abs|``), ``clipped`` (some element was) and
      the counters ``count``, ``step``, ``clipped_count``, ``nonfinite_count``.

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
    _validation.check("max_abs", max_abs, lambda x: not math.isnan(x), "a number, not NaN")
    _grouping.validate_scope(scope)
    _check_name(name)

    def kernel(leaves: list[Array], grouping: Grouping, dtype: Any) -> _Step:
        limit = jnp.abs(jnp.asarray(max_abs, dtype))
        bound = jnp.broadcast_to(limit, (grouping.num_groups,))
        norm, counts = _norms_and_clipped(leaves, grouping, bound, dtype)
        fraction = _fraction(counts, grouping, dtype)
        out = _clamp(leaves, grouping, bound)
        metrics = {"grad_norm": norm, "clipped_fraction": fraction, "clipped": fraction > 0}
        return _Step(out, metrics, jnp.isfinite(norm), fraction > 0)

    fields = {"grad_norm": None, "clipped_fraction": None, "clipped": jnp.bool_}
    return _static_transform("clip_by_value", scope, name, fields, kernel)


def clip_by_percentile(
    percentile: float,
    scope: Scope = "per_param",
    method: str = "auto",
    *,
    name: str | None = None,
) -> _engine.ClipTransform:
    """Clamps the updates to the ``percentile``-th percentile of their magnitudes.

    Per group, the bound ``b`` is the linearly interpolated percentile
    (numpy's default method) of ``|g|`` over the group's elements: each leaf
    with ``scope="per_param"``, all leaves together with ``scope="global"``,
    the leaves of one parent with ``"per_layer"``. Then ``clip(g, -b, b)``.

    ``method="exact"`` sorts the group's magnitudes; ``"approx"`` uses a radix
    histogram select that reads them twice (float32) and is within a relative
    ``2^-17`` (≈ 7.6e-6) of the exact bound, see
    :func:`clipjax._percentile.approx_percentile`; ``"auto"`` is exact for
    groups of up to ``AUTO_EXACT_MAX_SIZE`` (4096) elements and approximate
    above. The global scope never concatenates large leaves.

    A group with a non-finite norm (any NaN or inf) is passed through
    unchanged, reports ``bound = inf`` and ``clipped_fraction = 0`` and
    increments ``nonfinite_count``. Leaves must be real-valued.
    With bfloat16/float16 leaves the bound is rounded to the leaf dtype before
    clamping. ``percentile`` may be injected with
    ``optax.inject_hyperparams`` (its rank is then computed in float32);
    ``scope`` and ``method`` are static.

    Args:
      percentile: in ``(0, 100]``; 100 is the maximum (nothing clipped).
      scope: ``"per_param"``, ``"per_layer"``, ``"global"`` or a callable
        ``(path, leaf) -> str``.
      method: ``"auto"``, ``"exact"`` or ``"approx"``.
      name: metrics prefix (default ``clip_by_percentile``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state records per
      group ``grad_norm`` (L2, before clipping), ``bound``,
      ``clipped_fraction``, ``clipped`` and the counters ``count``, ``step``,
      ``clipped_count``, ``nonfinite_count``.

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
    _validation.check("percentile", percentile, lambda x: 0 < x <= 100, "in (0, 100]")
    _validation.choice("method", method, PERCENTILE_METHODS)
    _grouping.validate_scope(scope, PERCENTILE_SCOPES)
    _check_name(name)

    def kernel(leaves: list[Array], grouping: Grouping, dtype: Any) -> _Step:
        bounds = [
            _percentile._select([leaves[i] for i in members], percentile, method)[0]
            for members in grouping.members
        ]
        bound = jnp.stack(bounds).astype(dtype) if bounds else jnp.zeros((0,), dtype)
        norm, counts = _norms_and_clipped(leaves, grouping, bound, dtype)
        finite = jnp.isfinite(norm)
        # Selects on [groups] only: a non-finite group's leaves pass unchanged.
        bound = jnp.where(finite, bound, jnp.inf)
        fraction = _fraction(jnp.where(finite, counts, jnp.zeros_like(counts)), grouping, dtype)
        out = _clamp(leaves, grouping, bound)
        metrics = {
            "grad_norm": norm,
            "bound": bound,
            "clipped_fraction": fraction,
            "clipped": fraction > 0,
        }
        return _Step(out, metrics, finite, fraction > 0)

    fields = {"grad_norm": None, "bound": None, "clipped_fraction": None, "clipped": jnp.bool_}
    return _static_transform("clip_by_percentile", scope, name, fields, kernel)


def normalize_per_param(eps: float = 1e-8, *, name: str | None = None) -> _engine.ClipTransform:
    """Scales every leaf to unit L2 norm: ``g / (‖g‖ + eps)``.

    drytorch's ``GradParamNormalizer``. One pass computes all leaf norms (in
    float32, float64 for float64 leaves), then each leaf is multiplied by the
    scalar ``1 / (‖g‖ + eps)`` in its own dtype. A leaf with a non-finite norm
    passes through unchanged and increments ``nonfinite_count``. ``eps`` may
    be injected with ``optax.inject_hyperparams``.

    Args:
      eps: added to the norm in the denominator, ``>= 0``.
      name: metrics prefix (default ``normalize_per_param``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state records per
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
    _check_name(name)

    def kernel(leaves: list[Array], grouping: Grouping, dtype: Any) -> _Step:
        norm = _grouping.group_norms(leaves, grouping)
        finite = jnp.isfinite(norm)
        scale = jnp.where(finite, 1 / (norm + jnp.asarray(eps, dtype)), jnp.ones_like(norm))
        out = _grouping.apply_scales(leaves, grouping, scale)
        return _Step(out, {"grad_norm": norm}, finite, None)

    return _static_transform("normalize_per_param", "per_param", name, {"grad_norm": None}, kernel)


def zscore_normalize(eps: float = 1e-8, *, name: str | None = None) -> _engine.ClipTransform:
    """Standardises every leaf: ``(g - mean) / (std + eps)``, ``std`` with ddof=1.

    drytorch's ``GradZScoreNormalizer``. Mean and standard deviation are taken
    over the leaf's elements in float32 (float64 for float64 leaves), by the
    corrected two-pass algorithm (mean, then the sums of the deviations and of
    their squares), which stays accurate when ``|mean| >> std``; the result is
    cast back to the leaf's dtype. Leaves must be real-valued.

    **FIX**: a one-element leaf becomes 0 (its deviation from its own mean);
    drytorch divides by the undefined ddof=1 std and gives NaN. A leaf with a
    non-finite norm passes through unchanged and increments
    ``nonfinite_count``. ``eps`` may be injected with
    ``optax.inject_hyperparams``.

    Args:
      eps: added to the standard deviation in the denominator, ``>= 0``.
      name: metrics prefix (default ``zscore_normalize``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state records per
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
    _check_name(name)

    def kernel(leaves: list[Array], grouping: Grouping, dtype: Any) -> _Step:
        norms, finites, out = [], [], []
        for x in leaves:
            size = x.size
            if size == 0:
                norms.append(jnp.zeros((), dtype))
                finites.append(jnp.ones((), bool))
                out.append(x)
                continue
            xs = x.astype(dtype)
            total, squares = _fused_sums(xs, xs * xs)
            norm = jnp.sqrt(squares)
            ok = jnp.isfinite(norm)
            # Corrected two-pass (Chan, Golub & LeVeque 1983): the second pass
            # sums the deviations from the first mean too, and the output
            # subtracts the two parts separately, so a leaf whose mean is far
            # larger than its spread does not lose its deviations to the
            # rounding of the mean.
            rough = total / size
            deviation = xs - rough
            deviation_sum, deviation_squares = _fused_sums(deviation, deviation * deviation)
            residual = deviation_sum / size
            if size > 1:
                centred = deviation_squares - size * jnp.square(residual)
                std = jnp.sqrt(jnp.maximum(centred, 0) / (size - 1))
                inverse = 1 / (std + jnp.asarray(eps, dtype))
            else:
                inverse = jnp.zeros((), dtype)  # FIX: drytorch gives NaN here.
            norms.append(norm)
            finites.append(ok)
            rough = jnp.where(ok, rough, jnp.zeros_like(rough))
            residual = jnp.where(ok, residual, jnp.zeros_like(residual))
            scale = jnp.where(ok, inverse, jnp.ones_like(inverse))
            out.append((((xs - rough) - residual) * scale).astype(x.dtype))
        norm = jnp.stack(norms) if norms else jnp.zeros((0,), dtype)
        finite = jnp.stack(finites) if finites else jnp.zeros((0,), bool)
        return _Step(out, {"grad_norm": norm}, finite, None)

    return _static_transform("zscore_normalize", "per_param", name, {"grad_norm": None}, kernel)
