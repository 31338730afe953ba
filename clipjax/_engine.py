"""The one engine every norm-based clipper runs on.

An algorithm is described by a :class:`NormRule`: how to initialise its
statistics (stacked ``[groups, ...]`` arrays), how one finite observation
updates them, and how statistics and the current norm decide a threshold and
a scale. The engine does everything else, once, for every clipper:

1. group the leaves by ``scope`` and compute all group norms in one pass;
2. average them over ``axis_name`` when given (SPEC 5);
3. feed finite norms to the statistics and keep non-finite ones out: the
   group's statistics and count stay as they were, its gradient passes
   through (scale 1) and ``nonfinite_count`` grows (SPEC 3);
4. apply one scalar per group with a plain multiply (SPEC 7);
5. record the metrics and counters in the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _grouping, _metrics
from clipjax._grouping import Scope

Stats = Any
Array = jax.Array


class Decision(NamedTuple):
    """What a rule decides for one step, per group (all ``[groups]``).

    Attributes:
      threshold: the threshold to report (``target`` for AGC).
      scale: the multiplier to apply, in [0, 1], assuming a finite norm.
      extra: per-step metrics beyond the statistics (e.g. zclip's ``z``).
      in_warmup: groups whose warm-up transform applies this step, or None.
    """

    threshold: Array | None
    scale: Array
    extra: dict[str, Array] = {}
    in_warmup: Array | None = None


def _no_stats(num_groups: int, dtype: Any) -> Stats:
    return ()


def _no_report(stats: Stats) -> dict[str, Array]:
    return {}


@dataclasses.dataclass(frozen=True)
class NormRule:
    """An algorithm, as the engine sees it.

    Attributes:
      algo: the factory's name, used as metrics prefix.
      decide: ``(stats_before, stats_after, norm, count, aux) -> Decision``;
        ``count`` is the number of finite observations before this step (this
        step's observation is number ``count + 1``); ``aux`` holds
        ``weight_norm`` for rules that need params.
      init: ``(num_groups, dtype) -> stats``, stacked ``[groups, ...]`` arrays.
      observe: ``(stats, norm, count_before) -> stats`` for one finite norm;
        None for stateless rules.
      report: ``stats -> {name: [groups]}``, the statistics to record.
      ord: the norm's order (2 unless a static clipper says otherwise).
      threshold_name: the metric name of ``Decision.threshold``.
      needs_params: whether ``decide`` needs the group norms of ``params``.
      leaf_filter: ``(path, leaf) -> bool``; leaves it rejects are left out of
        the norms and pass through unscaled.
    """

    algo: str
    decide: Callable[..., Decision]
    init: Callable[[int, Any], Stats] = _no_stats
    observe: Callable[[Stats, Array, Array], Stats] | None = None
    report: Callable[[Stats], dict[str, Array]] = _no_report
    ord: float = 2.0
    threshold_name: str | None = "threshold"
    needs_params: bool = False
    leaf_filter: Callable[[Any, Any], bool] | None = None


class ClipTransform(optax.GradientTransformationExtraArgs):
    """A clipjax transform: an optax transform that also knows its rule.

    It is an ``optax.GradientTransformationExtraArgs`` in every respect; the
    extra attributes let one clipjax transform reuse another's rule (hist_clip
    fuses a clipjax ``warmup_clip`` into its own single pass).
    """

    rule: NormRule | None = None
    rescope: Callable[[Scope], ClipTransform] | None = None


def state_class(name: str, doc: str) -> type:
    """A NamedTuple state class with a unique ``name`` (for ``tree_get``)."""
    cls = NamedTuple(
        name,
        [
            ("stats", Any),
            ("metrics", dict),
            ("info", _metrics.GroupInfo),
            ("inner", Any),
            ("leaf_index", tuple),
        ],
    )
    cls.__new__.__defaults__ = (None, ())
    cls.__doc__ = (
        f"{doc}\n\n"
        "Attributes:\n"
        "  stats: the algorithm's statistics, stacked ``[groups, ...]`` arrays.\n"
        "  metrics: ``{field: [groups] array}``, read by :func:`clipjax.metrics`.\n"
        "  info: static names (algorithm, prefix, groups); no array leaves.\n"
        "  inner: the state of a nested transform (hist_clip's ``warmup_clip``).\n"
        "  leaf_index: each leaf's group index as an int32 scalar (empty for one\n"
        "    group); see :func:`clipjax._grouping.apply_scales`.\n"
    )
    cls.__module__ = "clipjax"
    return _metrics.register_state(cls)


def _check_state(state: Any, grouping: _grouping.Grouping, info: _metrics.GroupInfo) -> None:
    if state.info.groups != grouping.names or state.info.tree != grouping.fingerprint:
        raise ValueError(
            f"{info.algo}: the tree passed to update does not match the tree passed to "
            f"init: init saw groups {_grouping._short(state.info.groups)}, update got "
            f"{_grouping._short(grouping.names)} (leaf names or shapes differ: "
            f"{len(grouping.leaf_names)} leaves {_grouping._short(grouping.leaf_names)})."
        )
    for field, value in state.metrics.items():
        if jnp.shape(_metrics._unwrap(value))[:1] != (grouping.num_groups,):
            raise ValueError(
                f"{info.algo}: state field {field!r} has shape {jnp.shape(value)}, expected "
                f"[{grouping.num_groups}] for the groups of this tree; was the state "
                "restored from another model?"
            )


def own_buffers(state: Any) -> Any:
    """Gives every state leaf its own buffer.

    ``init`` builds several fields from one ``zeros``; a jitted step that
    donates the state would then donate one buffer twice and fail.
    """
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def _where_groups(mask: Array, new: Stats, old: Stats) -> Stats:
    """Per-group select on stacked statistics (``[groups, ...]`` arrays)."""

    def pick(n: Array, o: Array) -> Array:
        m = mask.reshape(mask.shape + (1,) * (n.ndim - 1))
        return jnp.where(m, n, o)

    return jax.tree.map(pick, new, old)


def _counter(num_groups: int) -> Array:
    return jnp.zeros((num_groups,), jnp.int32)


def counters(num_groups: int) -> dict[str, Array]:
    return {
        "count": _counter(num_groups),
        "step": _counter(num_groups),
        "clipped_count": _counter(num_groups),
        "nonfinite_count": _counter(num_groups),
    }


def advance_counters(
    metrics: dict[str, Array], observed: Array, clipped: Array, finite: Array
) -> dict[str, Array]:
    one = jnp.ones((), jnp.int32)
    return {
        "count": metrics["count"] + observed.astype(jnp.int32),
        "step": metrics["step"] + one,
        "clipped_count": metrics["clipped_count"] + clipped.astype(jnp.int32),
        "nonfinite_count": metrics["nonfinite_count"] + (~finite).astype(jnp.int32),
    }


def gate_scale(threshold: Array, norm: Array, eps: Any, gate_open: Array) -> Array:
    """``min(1, T / (g + eps))`` where the gate is open, else 1 (SPEC 3).

    A select on ``[groups]``-sized arrays only; the leaves see one multiply.
    """
    scale = jnp.minimum(1.0, threshold / (norm + eps))
    return jnp.where(gate_open, scale, jnp.ones_like(scale))


def observe_then_clip(threshold: Array, norm: Array, count: Array, eps: Any, gate: Any) -> Decision:
    """smartclip's rule: the threshold already includes this step's observation.

    The gate opens once the group has ``gate`` finite observations counting
    this one (smartclip: ``t + 1 >= max(warmup_steps, min_history)``).
    """
    return Decision(threshold, gate_scale(threshold, norm, eps, count + 1 >= gate))


def smartclip_observation(norm: Array, eps: Any) -> Array:
    """What smartclip feeds its statistics: ``g if g > 0 else eps`` (``ensure_positive``).

    With ``guard_nans=False`` this is also how a NaN enters them: as ``eps``.
    """
    return jnp.where(norm > 0, norm, jnp.asarray(eps, norm.dtype))


def _filtered_grouping(tree: Any, scope: Scope, rule: NormRule) -> tuple[Any, ...]:
    leaves, paths, treedef = _grouping.leaves_with_names(tree)
    grouping = _grouping.make_grouping(tree, scope)
    if rule.leaf_filter is None:
        keep = None
    else:
        keep = tuple(bool(rule.leaf_filter(p, x)) for p, x in zip(paths, leaves))
    return leaves, treedef, grouping, keep


def _norms(leaves: list[Array], grouping: Any, keep: Any, ord: float) -> Array:
    if keep is None:
        return _grouping.group_norms(leaves, grouping, ord)
    zero = [x if k else jnp.zeros((), x.dtype) for x, k in zip(leaves, keep)]
    return _grouping.group_norms(zero, grouping, ord)


def _apply(
    leaves: list[Array], grouping: Any, keep: Any, scale: Array, index: tuple = ()
) -> list[Array]:
    scaled = _grouping.apply_scales(leaves, grouping, scale, index)
    if keep is None:
        return scaled
    return [s if k else x for x, s, k in zip(leaves, scaled, keep)]


def advance(
    rule: NormRule,
    state: Any,
    norm: Array,
    aux: dict[str, Array],
    guard_nans: bool = True,
    observe_mask: Array | None = None,
) -> tuple[Array, Any, Decision]:
    """One step of ``rule`` from group norms alone: ``(scale, new_state, decision)``.

    Non-finite norms never reach the statistics (unless ``guard_nans`` is
    False) and always get scale 1. ``observe_mask`` further limits which groups
    advance (a warm-up transform advances only on warm-up steps).
    """
    finite = jnp.isfinite(norm)
    observed = finite if guard_nans else jnp.ones_like(finite)
    if observe_mask is not None:
        observed = observed & observe_mask
    count = state.metrics["count"]
    stats_before = state.stats
    if rule.observe is None:
        stats_after = stats_before
    else:
        stats_after = _where_groups(observed, rule.observe(stats_before, norm, count), stats_before)
    decision = rule.decide(stats_before, stats_after, norm, count, aux)
    scale = jnp.where(finite, decision.scale, jnp.ones_like(decision.scale)).astype(norm.dtype)
    clipped = scale < 1
    metrics = {"grad_norm": norm}
    if rule.threshold_name is not None:
        metrics[rule.threshold_name] = decision.threshold
    metrics["scale"] = scale
    metrics["clipped"] = clipped
    metrics.update(advance_counters(state.metrics, observed, clipped, finite))
    metrics.update(_report(rule, stats_after, decision))
    metrics = {k: jnp.asarray(v).astype(state.metrics[k].dtype) for k, v in metrics.items()}
    if observe_mask is not None:
        metrics = _where_groups(observe_mask, metrics, state.metrics)
    return scale, state._replace(stats=stats_after, metrics=metrics), decision


def norm_transform(
    rule: NormRule,
    *,
    scope: Scope = "global",
    name: str | None = None,
    axis_name: str | None = None,
    guard_nans: bool = True,
    warmup: Any = None,
    rebuild: Callable[[Scope], ClipTransform] | None = None,
) -> ClipTransform:
    """Builds the optax transform that runs ``rule`` over groups of leaves.

    Args:
      rule: the algorithm.
      scope: ``"global"``, ``"per_param"``, ``"per_layer"`` or a callable.
      name: metrics prefix replacing ``rule.algo``.
      axis_name: average the group norms over this mapped axis first.
      guard_nans: keep non-finite norms out of the statistics (SPEC 8.3).
      warmup: a transform applied to groups whose ``Decision.in_warmup`` is
        set. A clipjax norm clipper is rescoped to ``scope`` and fused into the
        same pass (its scale comes from the same norms); any other optax
        transform is applied to the whole tree under ``lax.cond`` while some
        group is warming up. Its state advances on warm-up steps only.
      rebuild: ``scope -> transform`` with the same hyperparameters, so that
        another clipper can fuse this one (see ``warmup``).
    """
    _grouping.validate_scope(scope)
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    fused = None
    if warmup is not None and getattr(warmup, "rescope", None) is not None:
        fused = warmup.rescope(scope)
        if fused.rule.ord != rule.ord or fused.rule.needs_params or fused.rule.leaf_filter:
            fused = None

    def init_fn(params: Any) -> Any:
        _metrics.ensure_serializable()
        leaves, _, grouping, _ = _filtered_grouping(params, scope, rule)
        num_groups = grouping.num_groups
        dtype = _grouping.norm_dtype(leaves)
        stats = rule.init(num_groups, dtype)
        zeros = jnp.zeros((num_groups,), dtype)
        aux = {"weight_norm": zeros} if rule.needs_params else {}
        shapes = jax.eval_shape(
            lambda s: _decide_and_report(rule, s, s, zeros, _counter(num_groups), aux), stats
        )
        metrics = {"grad_norm": zeros}
        if rule.threshold_name is not None:
            metrics[rule.threshold_name] = zeros
        metrics["scale"] = jnp.ones((num_groups,), dtype)
        metrics["clipped"] = jnp.zeros((num_groups,), bool)
        metrics.update(counters(num_groups))
        for key, shape in shapes.items():
            metrics[key] = jnp.zeros(shape.shape, shape.dtype)
        if warmup is None:
            inner = None
        elif fused is not None:
            inner = fused.init(params)
        else:
            inner = warmup.init(params)
        info = _metrics.GroupInfo(rule.algo, name, grouping.names, grouping.fingerprint)
        index = _grouping.leaf_index(grouping)
        return own_buffers(_STATE_TYPES[rule.algo](stats, metrics, info, inner, index))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del extra_args
        leaves, treedef, grouping, keep = _filtered_grouping(updates, scope, rule)
        _check_state(state, grouping, state.info)
        norm = _norms(leaves, grouping, keep, rule.ord)
        aux = {}
        if rule.needs_params:
            if params is None:
                raise ValueError(
                    f"{rule.algo} needs the parameters: call update(updates, state, params)."
                )
            p_leaves, _, p_grouping, p_keep = _filtered_grouping(params, scope, rule)
            grouping.check_matches(p_grouping, "update's params")
            aux["weight_norm"] = _norms(p_leaves, p_grouping, p_keep, 2.0)
        if axis_name is not None:
            norm = jax.lax.pmean(norm, axis_name)
            aux = jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), aux)
        scale, new_state, decision = advance(rule, state, norm, aux, guard_nans)

        new_leaves = None
        if warmup is not None and decision.in_warmup is not None:
            in_warmup = decision.in_warmup & jnp.isfinite(norm)
            if fused is not None:
                warm_scale, inner, _ = advance(
                    fused.rule, state.inner, norm, {}, True, observe_mask=in_warmup
                )
                scale = jnp.where(in_warmup, warm_scale, scale)
            else:
                new_leaves, inner = _generic_warmup(
                    warmup,
                    updates,
                    state.inner,
                    params,
                    leaves,
                    grouping,
                    keep,
                    scale,
                    in_warmup,
                )
            new_state = new_state._replace(inner=inner)
        if new_leaves is None:
            new_leaves = _apply(leaves, grouping, keep, scale, state.leaf_index)
        # Returned through a copy, not passed through: a pass-through output
        # cannot reuse its donated input buffer (and JAX warns about it).
        new_state = new_state._replace(leaf_index=tuple(jnp.copy(i) for i in state.leaf_index))
        return jax.tree_util.tree_unflatten(treedef, new_leaves), new_state

    tx = ClipTransform(init_fn, update_fn)
    tx.rule = rule
    tx.rescope = rebuild
    return tx


def _report(rule: NormRule, stats: Stats, decision: Decision) -> dict[str, Array]:
    out = dict(rule.report(stats))
    out.update(decision.extra)
    return out


def _decide_and_report(
    rule: NormRule, before: Stats, after: Stats, norm: Array, count: Array, aux: dict
) -> dict[str, Array]:
    return _report(rule, after, rule.decide(before, after, norm, count, aux))


def _generic_warmup(
    warmup: Any,
    updates: Any,
    inner: Any,
    params: Any,
    leaves: list[Array],
    grouping: Any,
    keep: Any,
    scale: Array,
    in_warmup: Array,
) -> tuple[list[Array], Any]:
    """Any optax transform as warm-up: whole tree, only while a group warms up."""
    any_warm = jnp.any(in_warmup)

    def warm(_: Any) -> tuple[list[Array], Any]:
        out, new_inner = warmup.update(updates, inner, params)
        out_leaves = jax.tree_util.tree_leaves(out)
        scaled = _apply(leaves, grouping, keep, scale)
        mask = _grouping.leaf_scales(grouping, in_warmup)
        # A select on the warm-up path only (SPEC 8.15).
        return [jnp.where(m, w, s) for m, w, s in zip(mask, out_leaves, scaled)], new_inner

    def plain(_: Any) -> tuple[list[Array], Any]:
        return _apply(leaves, grouping, keep, scale), inner

    return jax.lax.cond(any_warm, warm, plain, None)


_STATE_TYPES: dict[str, type] = {}


def register_algo(algo: str, doc: str, class_name: str) -> type:
    """Creates and records the state class of ``algo``."""
    cls = state_class(class_name, doc)
    _STATE_TYPES[algo] = cls
    return cls
